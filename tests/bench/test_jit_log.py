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


def test_start_costs_split_a_cold_kvarn_start_from_a_real_log_shape():
    from kvarn.bench.jit_log import start_costs

    core = "(EngineCore pid=2943) INFO 12-04 03:29:{} [{}] {}"
    log = _log(core.format("49", "monitor.py:53", "torch.compile took 27.28 s in total"),
               _C.format("03.345", "_store_tiles_kernel", "11.18"), _C.format("06.898", "records_kernel", "2.62"),
               _C.format("39.729", "_flush_layers_kernel", "16.45"),
               core.format("40", "warmup.py:129", "kvarn: kernels warmed up for 32/8 heads, head_dim 128, bfloat16 "
                                                  "in 48.0 s (deferred flush on; KVARN_SINK=16)"),
               core.format("44", "model_runner.py:747", "Graph capturing finished in 4 secs, took 0.31 GiB"),
               core.format("02", "core.py:340", "init engine (profile, create kv cache, warmup model) took 100.96 s "
                                                "(compilation: 27.28 s)"),
               _C.format("03.000", "_topk_topp_kernel", "1.50"),  # the bench's untimed warm-up: not the start
               BURST_MARK, _C.format("37.048", "_dequant_kernel", "0.90"))
    assert start_costs(log) == {"start_jit_compiles": 3.0, "start_jit_compile_s": 30.25,
                                "start_torch_compile_s": 27.28, "start_graph_capture_s": 4.0,
                                "start_kvarn_warmup_s": 48.0}
    # an FP16 engine: no plugin warm-up line; a log without the engine's line counts up to the burst mark
    fp16 = _log(_C.format("10.000", "triton_poi_fused_2", "0.40"), BURST_MARK)
    assert start_costs(fp16) == {"start_jit_compiles": 1.0, "start_jit_compile_s": 0.4}
    assert start_costs(_log("Traceback (most recent call last):", "RuntimeError: CUDA out of memory")) == {}
    # tensor parallelism: each rank compiles the same kernels at once; the start waited for the slowest rank
    rank = "(Worker_TP{} pid=10{}) [kvarn] 05:21:{} triton compile {} {} s (H=8)"
    tp = _log(rank.format(0, 0, "10.000", "_store_tiles_kernel", "11.00"),
              rank.format(1, 1, "10.100", "_store_tiles_kernel", "12.50"),
              rank.format(1, 1, "23.000", "records_kernel", "2.50"), BURST_MARK)
    assert start_costs(tp) == {"start_jit_compiles": 2.0, "start_jit_compile_s": 15.0}


def test_the_summary_says_what_a_cold_start_paid_for():
    from kvarn.bench.view import start_notes

    rows = [{"kv_dtype": "kvarn_k4v2_g128", "status": "ok", "engine_start_s": 106.6, "start_jit_compiles": 82.0,
             "start_jit_compile_s": 64.25, "start_torch_compile_s": 27.28, "start_graph_capture_s": 4.0,
             "start_kvarn_warmup_s": 48.0},
            {"kv_dtype": "auto", "status": "ok", "engine_start_s": 40.0, "start_jit_compiles": 73.0,
             "start_jit_compile_s": 2.1},  # a warm cache: disk loads only, no line
            {"kv_dtype": "fp8", "status": "failed", "engine_start_s": float("nan")},
            {"kv_dtype": "fp8", "status": "ok", "engine_start_s": 50.0},  # an hf row or an older one: unknown
            {"kv_dtype": "turboquant_4bit_nc", "status": "ok", "engine_start_s": 180.0, "start_jit_compiles": 9.0,
             "start_jit_compile_s": float("nan")}]  # a compile line without its duration
    assert start_notes(rows)[1] == ("note: turboquant_4bit_nc engine start 180.0 s: 9 Triton compiles ? s (a cold "
                                    "compile cache: a rerun on this machine starts faster)")
    assert start_notes(rows)[:1] == [
        "note: kvarn_k4v2_g128 engine start 106.6 s: 82 Triton compiles 64.2 s, torch.compile 27.3 s, graph capture "
        "4.0 s, kvarn kernel warm-up (its compiles included) 48.0 s (a cold compile cache: a rerun on this machine "
        "starts faster)"]
