"""Synthetic bench rows for the gate tests (shared by the gate test modules)."""
from kvarn.report.fixtures import bench_row
from kvarn.results import ResultsStore

M = "Qwen/Qwen3-8B"  # a bundled shape's label, as bench rows name it


def write_bench(root, tps: dict, *, kv_tokens=None, repeats=3, bad=None, run_id="r"):
    """tps: kv_dtype -> output tok/s (same value each repeat, small jitter); bad: (kv_dtype, repeat) -> row overrides."""
    kv_tokens = kv_tokens or {"auto": 800_000, "fp8": 1_600_000, "kvarn_k4v2_g128": 3_600_000}
    rows = []
    for kv, v in tps.items():
        for r in range(repeats):
            row = bench_row(M, kv, 1, repeat=r, output_tok_s=v * (1 + 0.002 * (r - 1)), kv_tokens=kv_tokens[kv],
                            burst=16384, run_id=run_id)
            if bad and (kv, r) in bad:
                row.update(bad[(kv, r)])
            rows.append(row)
    ResultsStore(root).append(rows)
    return root


BASE_TPS = {"auto": 2600.0, "fp8": 3100.0, "kvarn_k4v2_g128": 4500.0}


def hf_run(root, repeats=3, run_id="cpu", model="HuggingFaceTB/SmolLM2-135M-Instruct"):
    """A CPU run of the transformers engine: its honest KV ratios are ~2x, not vLLM's 4.5x."""
    kv = {"auto": 1_000_000, "fp8": 1_900_000, "kvarn_k4v2_g128": 2_100_000}
    rows = [bench_row(model, k, 1, repeat=r, output_tok_s=40.0 + r * 0.01, kv_tokens=kv[k], burst=192,
                      prompt_len=64, output_len=128, requests=2, engine="hf", run_id=run_id)
            for k in kv for r in range(repeats)]
    ResultsStore(root).append(rows)
    return root
