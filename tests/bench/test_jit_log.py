"""Kernels compiled during a cell's timed burst, from its engine log (kvarn.bench.jit_log), and the summary's note."""
import math

from kvarn.engines.vllm_log import BURST_MARK
from kvarn.bench.jit_log import midrun_compiles
from kvarn.bench.view import stall_notes

_C = "(EngineCore pid=5547) [kvarn] 05:21:{} triton compile {} {} s (H=8 G=128; 16: k_ptr)"
_MON = "(EngineCore pid=5547) INFO 11-30 05:21:22 [jit_monitor.py:79] Kernel JIT monitor activated; ..."


def _log(*body):
    return "\n".join(["$ python -m kvarn.engines.vllm_worker spec.json result.json", *body])


def test_counts_only_what_compiled_after_the_burst_mark_of_the_latest_attempt():
    old = _log(_MON, BURST_MARK, _C.format("01.000", "_old_kernel", "9.00"))
    log = old + "\n" + _log(_C.format("10.000", "_store_tiles_kernel", "5.10"), _MON,
                            _C.format("28.754", "_store_tiles_kernel", "5.77"), BURST_MARK,
                            _C.format("37.048", "_store_tiles_kernel", "6.27"),
                            _C.format("40.956", "_dequant_kernel", "0.01") + ", disk cache (H=8)")
    got = midrun_compiles(log)
    assert got == {"jit_compiles": 2.0, "jit_compile_s": 6.28,
                   "jit_kernels": "_store_tiles_kernel 6.3 s, _dequant_kernel 0.0 s"}


def test_without_a_burst_mark_nothing_is_known():
    """A cell that died before its burst (or an older worker's log): no count, not a count of zero; compiles after
    vLLM's warm-up but before the mark belong to the bench's untimed warm-up burst."""
    assert midrun_compiles(_log(_C.format("10.000", "a", "1.00"), _MON, _C.format("28.754", "b", "2.50"))) == {}
    assert midrun_compiles(_log("Traceback (most recent call last):", "RuntimeError: CUDA out of memory")) == {}


def test_tensor_parallel_ranks_compiling_together_count_once_and_untimed_lines_count():
    rank = "(Worker_TP{} pid=10{}) [kvarn] 05:21:{} triton compile {} {} s (H=8)"
    log = _log(BURST_MARK, rank.format(0, 0, "37.000", "_store_tiles_kernel", "6.20"),
               rank.format(1, 1, "37.100", "_store_tiles_kernel", "6.30"),
               rank.format(1, 1, "38.000", "_dequant_kernel", "?"))
    got = midrun_compiles(log)
    assert got["jit_compiles"] == 2 and math.isnan(got["jit_compile_s"])
    assert got["jit_kernels"] == "_store_tiles_kernel 6.3 s, _dequant_kernel"


def test_the_summary_notes_a_row_that_compiled_mid_run():
    rows = [{"kv_dtype": "kvarn_k4v2_g128", "repeat": 0, "status": "ok", "itl_ms_max": 3_976.0, "itl_ms_p50": 33.8,
             "jit_compiles": 2.0, "jit_compile_s": 7.6,
             "jit_kernels": "_store_tiles_kernel 6.3 s, _dequant_kernel 1.3 s"},
            {"kv_dtype": "auto", "repeat": 0, "status": "ok", "itl_ms_max": 4_000.0, "itl_ms_p50": 30.0,
             "jit_compiles": 0.0, "jit_compile_s": 0.0, "jit_kernels": ""},
            {"kv_dtype": "fp8", "repeat": 0, "status": "ok", "itl_ms_max": 40.0, "itl_ms_p50": 30.0,
             "jit_compiles": math.nan},
            # three loads from Triton's disk cache: no stall worth a note
            {"kv_dtype": "kvarn_k4v2_g128", "repeat": 1, "status": "ok", "itl_ms_max": 131.0, "itl_ms_p50": 3.4,
             "jit_compiles": 3.0, "jit_compile_s": 0.03, "jit_kernels": "_store_tiles_kernel 0.0 s, ..."},
            {"kv_dtype": "auto", "repeat": float("nan"), "status": "ok"}]
    notes = stall_notes(rows)
    assert notes == [
        "note: kvarn_k4v2_g128 (repeat 0): 2 kernel compile(s) during the timed burst, 7.6 s (_store_tiles_kernel "
        "6.3 s, _dequant_kernel 1.3 s): every running request waited; its throughput is understated",
        "note: auto (repeat 0): one inter-token gap took 4.0 s against an ITL p50 of 30.0 ms, a stall all running "
        "requests shared (its log shows no kernel compile in the burst): its throughput is understated"]
