"""Result row schema (version 1). Rows are flat dicts; unknown extra columns are kept (forward compatible).

Row kinds (`kind` column): "bench" (one configuration x repeat of `kvarn bench`), "eval" (summary of one task x
format), "sample" (one problem of an eval, per-sample details), "fidelity" (one format of `kvarn fidelity`).
"""
from __future__ import annotations

import hashlib
import json
import uuid

SCHEMA_VERSION = 1
KINDS = ("bench", "eval", "sample", "fidelity")  # the `kind` column
STATUSES = ("ok", "failed", "timeout", "oom", "skipped")
ENGINES = ("vllm", "hf")  # the `engine` column

# Columns every row has, with their pandas/arrow dtype. Metric columns are float64 (NaN where absent).
CORE_COLUMNS: dict[str, str] = {
    "schema_version": "int64",
    "row_id": "string",
    "run_id": "string",  # one invocation of bench / eval / suite
    "kind": "string",  # bench | eval | sample | fidelity
    "config_hash": "string",  # hash of the configuration fields (without repeat): resume key with `repeat`
    "repeat": "int64",
    "created_at": "string",  # ISO 8601 UTC
    "status": "string",  # ok | failed | timeout | oom | skipped
    "error": "string",
    # configuration
    "model": "string",
    "kv_dtype": "string",
    "engine": "string",  # ENGINES
    "tp": "int64",
    "task": "string",  # eval task; "" for bench rows
    "seed": "int64",
}
BENCH_METRICS = (
    "output_tok_s", "total_tok_s", "request_throughput", "duration_s", "engine_start_s",
    "kv_tokens", "kv_ratio_vs_fp16", "max_concurrency", "peak_running", "preemptions", "gpu_mem_gib",
    "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99",
    "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "e2el_ms_p50", "e2el_ms_p90", "e2el_ms_p99",
    "goodput_req_s", "output_tok_s_ratio_vs_fp16", "completed", "num_requests",
    # added with `kvarn bench` (schema stays version 1: columns are only ever added)
    "failed_requests", "total_input_tokens", "total_output_tokens", "kv_blocks", "kv_cache_gib", "kv_usage_peak",
    "peak_waiting", "ttft_ms_mean", "tpot_ms_mean", "itl_ms_mean", "e2el_ms_mean", "wall_s", "itl_ms_max",
    "jit_compiles", "jit_compile_s",
    "start_jit_compiles", "start_jit_compile_s", "start_torch_compile_s", "start_graph_capture_s",
    "start_kvarn_warmup_s",
    # the hf engine's accuracy axis: chunked perplexity of a short window through the row's format (fp16 in lockstep)
    "ppl", "ppl_fp16", "ppl_delta_pct",
)
# Configuration columns of bench rows besides the core ones (docs/results.md).
BENCH_CONFIG_COLUMNS = ("mode", "burst", "prompt_len", "output_len", "requests", "gpu_memory_utilization",
                        "max_num_seqs", "dummy_weights", "model_dtype", "engine_args", "request_rate", "burstiness",
                        "concurrency_limit", "goodput", "weights")
# Which FP16 row a bench row's *_ratio_vs_fp16 columns were taken against (kvarn/bench/ratios.py): its row_id
# (comma-joined when the ratio is against the mean over that run's repeats), run_id and GPU, and the scope:
# same-run | cross-run (asked for with --baseline-run) | unpaired (no FP16 row of this run: the ratios are NaN).
RATIO_COLUMNS = ("fp16_row_id", "fp16_run_id", "fp16_gpu", "ratio_scope")
EVAL_METRICS = ("n", "accuracy", "ppl", "ci_low", "ci_high", "delta_vs_fp16", "delta_ci_low", "delta_ci_high",
                "truncation_rate", "mean_gen_tokens")
# Provenance columns copied from kvarn.provenance.provenance() into every row.
PROVENANCE_COLUMNS = ("kvarn_version", "git_sha", "python", "torch", "triton", "vllm", "transformers", "cuda",
                      "driver", "gpu_count", "gpu_name", "kvarn_env", "gpu_names")

# The Parquet type of every column the schema names, applied on write, so a column that is null in one part (an
# offline row's request_rate, a CPU row's driver) is not written as Arrow's null type there and int or string in the
# next: readers that scan the directory as one dataset (`pd.read_parquet("results/parts")`) need one type per column.
# Nullable numbers are float64 (NaN = unset).
COLUMN_TYPES: dict[str, str] = {
    **CORE_COLUMNS,
    **{c: "float64" for c in BENCH_METRICS + EVAL_METRICS},
    "mode": "string", "burst": "int64", "prompt_len": "int64", "output_len": "int64", "requests": "int64",
    "gpu_memory_utilization": "float64", "max_num_seqs": "float64", "dummy_weights": "boolean",
    "model_dtype": "string", "engine_args": "string", "request_rate": "float64", "burstiness": "float64",
    "concurrency_limit": "float64", "goodput": "string", "weights": "string", "backend_env": "string",
    "jit_kernels": "string", **{c: "string" for c in RATIO_COLUMNS},
    **{c: "string" for c in PROVENANCE_COLUMNS if c != "gpu_count"}, "gpu_count": "int64",
}


def config_hash(config: dict) -> str:
    """Stable 16-hex hash of a configuration (keys sorted; the repeat index must not be in it)."""
    blob = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def new_row_id() -> str:
    return uuid.uuid4().hex[:16]
