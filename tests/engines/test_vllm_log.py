"""Reading a vLLM log: the line that says why the engine stopped, of the latest attempt only."""
from kvarn.engines.vllm_log import classify_error, last_error_line


def test_last_error_line():
    log = "INFO start\nTraceback (most recent call last):\n  File x\nValueError: bad block size\nINFO shutdown\n"
    assert last_error_line(log) == "ValueError: bad block size"
    # an out-of-memory line is the root cause even when other errors follow it (the server's shutdown traceback)
    log = ("(EngineCore pid=7) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
           "(APIServer pid=6) RuntimeError: Engine core initialization failed. See root cause above.\nINFO bye\n")
    assert last_error_line(log).startswith("(EngineCore pid=7) torch.OutOfMemoryError: CUDA out of memory")
    assert last_error_line("(APIServer pid=6) RuntimeError: x\nINFO bye\n") == "(APIServer pid=6) RuntimeError: x"
    assert last_error_line("") == "worker exited without output"


def test_last_error_line_reads_the_latest_attempt():
    """A rerun appends to the cell's log after a `$ command` header: an OOM of an earlier attempt is not this one's."""
    log = ("$ python -m worker a\nCUDA out of memory. Tried to allocate 2 GiB\n"
           "$ python -m worker b\nImportError: no module named x\n")
    assert last_error_line(log) == "ImportError: no module named x"


def test_out_of_memory_is_told_apart_from_other_failures():
    assert classify_error("ValueError: No available memory for the cache blocks") == "oom"
    assert classify_error("torch.OutOfMemoryError: CUDA out of memory") == "oom"
    assert classify_error("RuntimeError: Triton compile failed") == "failed"
