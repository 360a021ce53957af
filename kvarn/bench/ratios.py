"""Ratios against the FP16 (`auto`) row of the same model / TP / burst / split / requests / engine / mode.

At write time a row is compared with this run's FP16 row of the same repeat (else its mean over repeats), else
the latest FP16 row already stored (a resumed run). `with_ratios(df)` recomputes them for any table (readers).
"""
from __future__ import annotations

import math

from ..formats import FP16_NAMES

# every setting that moves KV capacity or throughput; the format's own knobs (kv_dtype, model_dtype: FP8 runs a
# bfloat16 model, backend_env: KVarN cells only) are what is compared, so they are not matched
MATCH = ("model", "tp", "burst", "prompt_len", "output_len", "requests", "engine", "mode", "gpu_memory_utilization",
         "max_num_seqs", "engine_args", "dummy_weights", "seed", "request_rate", "burstiness", "concurrency_limit")
_UNSET = ("", "{}", "null", "None", "nan")


def as_float(v) -> float:
    """A row value as a float, NaN where it is missing or not a number (None, pd.NA, text)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _ok(x: float) -> bool:
    return not math.isnan(x) and x > 0


def _unset(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and v in _UNSET)


def _same(a, b) -> bool:
    """One setting value: numbers compare by value (a stored 4096.0 is this run's 4096), bools as numbers, and
    missing (None / NaN / "" / "{}": a row older than the column, or the default) alike."""
    if _unset(a) or _unset(b):
        return _unset(a) and _unset(b)
    if isinstance(a, str) or isinstance(b, str):
        return str(a) == str(b)
    fa, fb = as_float(a), as_float(b)
    if math.isnan(fa) or math.isnan(fb):
        return math.isnan(fa) and math.isnan(fb)
    return fa == fb


def ratios(row: dict, ref: dict | None) -> dict:
    """kv_ratio_vs_fp16 (KV tokens, else inverse KV bytes on hf) and output_tok_s_ratio_vs_fp16."""
    out = {"kv_ratio_vs_fp16": float("nan"), "output_tok_s_ratio_vs_fp16": float("nan")}
    if ref is None or row.get("status") != "ok":
        return out
    kv, kv_ref = as_float(row.get("kv_tokens")), as_float(ref.get("kv_tokens"))
    if _ok(kv) and _ok(kv_ref):
        out["kv_ratio_vs_fp16"] = kv / kv_ref
    else:
        b, b_ref = as_float(row.get("kv_cache_gib")), as_float(ref.get("kv_cache_gib"))
        if _ok(b) and _ok(b_ref):
            out["kv_ratio_vs_fp16"] = b_ref / b
    t, t_ref = as_float(row.get("output_tok_s")), as_float(ref.get("output_tok_s"))
    if _ok(t) and _ok(t_ref):
        out["output_tok_s_ratio_vs_fp16"] = t / t_ref
    return out


def fp16_reference(row: dict, candidates: list[dict]) -> dict | None:
    """The FP16 row to compare `row` with, from `candidates` (this run first, then stored rows)."""
    same = [c for c in candidates if c.get("status") == "ok" and c.get("kv_dtype") in FP16_NAMES
            and all(_same(c.get(k), row.get(k)) for k in MATCH)]
    if not same:
        return None
    this_run = [c for c in same if c.get("run_id") == row.get("run_id")]
    pool = this_run or same
    rep = [c for c in pool if c.get("repeat") == row.get("repeat")]
    if rep:
        return rep[-1]
    if this_run:  # mean over this run's repeats
        keys = ("kv_tokens", "kv_cache_gib", "output_tok_s")
        return {k: sum(as_float(c.get(k)) for c in pool) / len(pool) for k in keys}
    return sorted(pool, key=lambda c: str(c.get("created_at", "")))[-1]


def with_ratios(df):
    """A copy of a bench table with both ratio columns recomputed row by row."""
    df = df.copy()
    rows = df.to_dict("records")
    kv, tok = [], []
    for r in rows:
        ref = r if r.get("kv_dtype") in FP16_NAMES and r.get("status") == "ok" else fp16_reference(r, rows)
        x = ratios(r, ref)
        kv.append(x["kv_ratio_vs_fp16"])
        tok.append(x["output_tok_s_ratio_vs_fp16"])
    df["kv_ratio_vs_fp16"], df["output_tok_s_ratio_vs_fp16"] = kv, tok
    return df
