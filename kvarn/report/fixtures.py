"""Illustrative result rows (NOT measurements) for tests and demos.

`bench_row` / `eval_row` build one schema-complete row; `write_demo_results` writes a realistic matrix
(models x TP x formats x bursts x repeats, plus eval summaries) through `ResultsStore`, with KV capacity from the
real capacity model and made-up but plausible throughput and accuracy. Its rows carry `run_id="demo-run"` by
default so nobody mistakes them for a real run.
"""
from __future__ import annotations

import math
import random
from pathlib import Path

from ..results import ResultsStore, config_hash

DEMO_GPU = "illustrative (no real GPU)"
DEMO_PROVENANCE = {
    "kvarn_version": "0.1.0", "git_sha": "0123abcd4567", "python": "3.11.9", "torch": "2.11.0",
    "triton": "3.5.0", "vllm": "0.26.0", "transformers": "4.56.0", "cuda": "12.8", "driver": "570.124.06",
    "gpu_count": 2, "gpu_name": DEMO_GPU,
}
DEMO_RUN_ID = "demo-run"
DEMO_MARKER = "ILLUSTRATIVE.txt"  # marks a directory `kvarn report --demo` wrote, so a rerun may replace its rows
DEMO_FORMATS = ("auto", "fp8", "kvarn_k4v2_g128", "kvarn_k4v4_g128", "turboquant_k8v4", "turboquant_4bit_nc")
LAT_KEYS = ("ttft", "tpot", "itl", "e2el")


def bench_config(model: str, kv_dtype: str, tp: int = 1, *, engine: str = "vllm", mode: str = "throughput",
                 burst: int = 16384, prompt_len: int | None = None, output_len: int = 256,
                 requests: int = 64) -> dict:
    return {"model": model, "kv_dtype": kv_dtype, "tp": tp, "engine": engine, "mode": mode, "burst": burst,
            "prompt_len": prompt_len if prompt_len is not None else burst, "output_len": output_len,
            "requests": requests}


def bench_row(model: str, kv_dtype: str, tp: int = 1, *, repeat: int = 0, status: str = "ok", error: str = "",
              output_tok_s: float = 1000.0, kv_tokens: float = 1e6, run_id: str = "demo-run", created_at=None,
              provenance: dict | None = None, completed: int | None = None, latency: bool | None = None,
              **config) -> dict:
    """One bench row. `completed` defaults to all requests when ok, to 0 otherwise."""
    cfg = bench_config(model, kv_dtype, tp, **{k: v for k, v in config.items() if k in
                                                 ("engine", "mode", "burst", "prompt_len", "output_len", "requests")})
    extra = {k: v for k, v in config.items() if k not in cfg}
    n = cfg["requests"]
    ok = status == "ok"
    row = {"kind": "bench", **cfg, "repeat": repeat, "status": status, "error": error, "seed": 0,
           "config_hash": config_hash(cfg), "run_id": run_id, "num_requests": n,
           "completed": (n if ok else 0) if completed is None else completed}
    if ok:
        total = output_tok_s * (1 + cfg["prompt_len"] / max(cfg["output_len"], 1))
        row.update(output_tok_s=output_tok_s, total_tok_s=total,
                   request_throughput=output_tok_s / max(cfg["output_len"], 1), kv_tokens=float(kv_tokens),
                   max_concurrency=kv_tokens / (cfg["prompt_len"] + cfg["output_len"]),
                   duration_s=n * cfg["output_len"] / output_tok_s)
        if latency if latency is not None else cfg["mode"] == "serve":
            base = 2000.0 * cfg["prompt_len"] / 16384
            tpot = 40.0 * 1000.0 / output_tok_s * 16
            for key, p50 in (("ttft", base), ("tpot", tpot), ("itl", tpot * 0.97), ("e2el", base + tpot * cfg["output_len"])):
                row[f"{key}_ms_p50"], row[f"{key}_ms_p90"], row[f"{key}_ms_p99"] = p50, p50 * 1.4, p50 * 2.1
    if created_at:
        row["created_at"] = created_at
    row.update(provenance if provenance is not None else DEMO_PROVENANCE)
    row.update(extra)
    return row


def eval_row(model: str, kv_dtype: str, task: str, *, tp: int = 1, n: int = 30, accuracy: float | None = None,
             ppl: float | None = None, delta: float | None = None, delta_ci: tuple[float, float] | None = None,
             ci: tuple[float, float] | None = None, status: str = "ok", error: str = "", run_id: str = "demo-run",
             provenance: dict | None = None, truncation_rate: float = 0.0, mean_gen_tokens: float = 0.0,
             samples: int = 1, **extra) -> dict:
    cfg = {"model": model, "kv_dtype": kv_dtype, "tp": tp, "task": task, "engine": "vllm"}
    row = {"kind": "eval", **cfg, "repeat": 0, "status": status, "error": error, "seed": 0,
           "config_hash": config_hash(cfg), "run_id": run_id, "n": float(n),
           "truncation_rate": truncation_rate, "mean_gen_tokens": mean_gen_tokens, "samples": samples}
    if accuracy is not None:
        row["accuracy"] = accuracy
        if ci is None:
            half = 1.96 * math.sqrt(max(accuracy * (1 - accuracy), 1e-4) / max(n, 1))
            ci = (max(0.0, accuracy - half), min(1.0, accuracy + half))
    if ppl is not None:
        row["ppl"] = ppl
    if ci is not None:
        row["ci_low"], row["ci_high"] = ci
    if delta is not None:
        row["delta_vs_fp16"] = delta
        if delta_ci is None:
            half = 0.0 if kv_dtype in ("auto", "float16", "bfloat16") else 1.96 * math.sqrt(0.12 / max(n * samples, 1))
            delta_ci = (delta - half, delta + half)
        row["delta_ci_low"], row["delta_ci_high"] = delta_ci
    row.update(provenance if provenance is not None else DEMO_PROVENANCE)
    row.update(extra)
    return row


# ---- a realistic matrix --------------------------------------------------------------------------------------------
# Throughput gain vs FP16 at a 16k burst (more sequences fit -> bigger batches), and accuracy change (points).
_SPEED = {"auto": 1.0, "fp8": 1.22, "kvarn_k4v2_g128": 1.74, "kvarn_k4v4_g128": 1.52, "kvarn_k4v2_g64": 1.66,
          "kvarn_k2v2_g128": 1.86, "turboquant_k8v4": 1.31, "turboquant_4bit_nc": 1.43, "turboquant_k3v4_nc": 1.47,
          "turboquant_3bit_nc": 1.55}
_ACC = {"auto": 0.0, "fp8": -0.004, "kvarn_k4v2_g128": -0.011, "kvarn_k4v4_g128": -0.003, "kvarn_k4v2_g64": -0.008,
        "kvarn_k2v2_g128": -0.06, "turboquant_k8v4": -0.006, "turboquant_4bit_nc": -0.035,
        "turboquant_k3v4_nc": -0.045, "turboquant_3bit_nc": -0.08}
_TASK_BASE = {"aime25": (0.70, 30, 8), "niah": (0.985, 200, 1), "gsm8k": (0.91, 1319, 1)}


def _capacity_tokens(model: str, kv_dtype: str, tp: int) -> float:
    try:
        from ..capacity import capacity
        from ..formats import get_format
        from ..shapes import resolve_model

        return float(capacity(resolve_model(model), get_format(kv_dtype), tp=tp, context=16384).kv_tokens)
    except Exception:  # unknown model or format: a plausible constant keeps the demo going
        return 1.0e6 * (16 / max(1.0, 16.0 / _SPEED.get(kv_dtype, 1.0)))


def write_demo_results(root: str | Path, *, models=(("qwen3-8b", 1), ("qwen3-32b", 2)), formats=DEMO_FORMATS,
                       bursts=(4096, 16384, 32768), repeats: int = 3, tasks=("aime25", "niah"), bench: bool = True,
                       evals: bool = True, mode: str = "serve", seed: int = 0, run_id: str = "demo-run",
                       failed: bool = True, scale: dict | None = None) -> ResultsStore:
    """Write a plausible (illustrative) matrix into ROOT. `scale` multiplies output_tok_s per kv_dtype."""
    rng = random.Random(seed)
    store = ResultsStore(root)
    rows: list[dict] = []
    scale = scale or {}
    for model, tp in models:
        base_tps = 2600.0 if "32b" not in model else 1450.0
        for fmt in formats if bench else ():
            kv = _capacity_tokens(model, fmt, tp)
            for burst in bursts:
                # the gain from capacity grows with the burst context: little at 4k, full at 16k+, a bit more at 32k
                g = 1 + (_SPEED.get(fmt, 1.0) - 1) * min(1.25, burst / 16384)
                for r in range(repeats):
                    if failed and fmt == "turboquant_4bit_nc" and burst == max(bursts) and tp == 1 and r == 1:
                        rows.append(bench_row(model, fmt, tp, repeat=r, status="oom", burst=burst, mode=mode,
                                              error="CUDA out of memory while allocating the decode workspace",
                                              run_id=run_id))
                        continue
                    tps = base_tps * g * (16384 / burst) ** 0.35 * scale.get(fmt, 1.0) * (1 + rng.gauss(0, 0.012))
                    rows.append(bench_row(model, fmt, tp, repeat=r, output_tok_s=tps, kv_tokens=kv, burst=burst,
                                          mode=mode, run_id=run_id))
        for task in tasks if evals else ():
            base, n, k = _TASK_BASE.get(task, (0.8, 100, 1))
            if "32b" in model:
                base = min(0.995, base + 0.05)
            for fmt in formats:
                d = _ACC.get(fmt, -0.02) * (1.0 if task == "aime25" else 0.5)
                acc = base + d
                rows.append(eval_row(model, fmt, task, tp=tp, n=n, accuracy=acc, delta=d, run_id=run_id,
                                     samples=k, mean_gen_tokens=9000.0 if task == "aime25" else 12.0,
                                     truncation_rate=0.03 if task == "aime25" else 0.0))
    store.append(rows)
    return store


def write_demo_dir(root: str | Path) -> ResultsStore:
    """`kvarn report DIR --demo`: (re)write the fixture matrix into DIR, a directory of its own. DIR must be new,
    empty, or one this function wrote before (its marker file, demo rows only): real results are never mixed with
    fixture rows."""
    from ..errors import KvarnError

    root = Path(root)
    if root.exists() and not root.is_dir():
        raise KvarnError(f"--demo: {str(root)!r} is a file; give a new directory, e.g. kvarn report demo --demo")
    store = ResultsStore(root)
    if root.is_dir() and any(root.iterdir()):
        rows = store.read() if store.files() else None
        real = 0 if rows is None or "run_id" not in rows else int((rows["run_id"] != DEMO_RUN_ID).sum())
        if not (root / DEMO_MARKER).is_file() or real:
            what = f"holds real results ({real or len(rows)} rows)" if rows is not None else "is not empty"
            raise KvarnError(f"--demo writes illustrative rows into a directory of its own, and {str(root)!r} {what}; "
                             "give a new or empty directory, e.g. kvarn report demo --demo (without --demo, "
                             f"kvarn report {root} renders what is there)")
        for part in store.files():
            part.unlink()
    root.mkdir(parents=True, exist_ok=True)
    (root / DEMO_MARKER).write_text("Rows written by `kvarn report --demo`: illustrative fixture data, not "
                                    "measurements.\n", encoding="utf-8")
    return write_demo_results(root)
