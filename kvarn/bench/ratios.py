"""Ratios against the FP16 (`auto`) row of the same model / TP / burst / split / requests / engine / mode, measured
in the same run on the same GPU.

A ratio is never taken against a row of another run by default: a resumed run whose FP16 cell was measured by an
earlier call leaves its candidates unpaired (NaN ratios, `ratio_scope` "unpaired") until that FP16 cell is rerun in
this run. Comparing with another run's FP16 row is asked for by name (`baseline_run`, `kvarn bench --baseline-run`)
and labelled `cross-run`. Every ratio row names the FP16 row(s) it used: `fp16_row_id`, `fp16_run_id`, `fp16_gpu`
(the device that ran it: the GPU's name, else the hf engine's torch device, e.g. "cpu").
`with_ratios(df)` recomputes all of it for any table (readers).
"""
from __future__ import annotations

import math

from ..formats import FP16_NAMES

# every setting that moves KV capacity or throughput; the format's own knobs (kv_dtype, model_dtype: FP8 runs a
# bfloat16 model, backend_env: KVarN cells only) are what is compared, so they are not matched
MATCH = ("model", "tp", "burst", "prompt_len", "output_len", "requests", "engine", "mode", "gpu_memory_utilization",
         "max_num_seqs", "engine_args", "dummy_weights", "seed", "request_rate", "burstiness", "concurrency_limit")
_UNSET = ("", "{}", "null", "None", "nan")
SAME_RUN, CROSS_RUN, UNPAIRED = "same-run", "cross-run", "unpaired"
# the columns naming the baseline of a row's ratios (kvarn.results.schema.RATIO_COLUMNS)
BASELINE_COLUMNS = ("fp16_row_id", "fp16_run_id", "fp16_gpu", "ratio_scope")


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


def _text(v) -> str:
    return "" if _unset(v) else str(v)


def device(row: dict) -> str:
    """What ran a row: its GPU's name, else the hf engine's torch device ("cpu"), else ""."""
    return _text(row.get("gpu_name")) or _text(row.get("hf_device"))


def ratios(row: dict, ref: dict | None) -> dict:
    """kv_ratio_vs_fp16 (KV tokens, else inverse KV bytes on hf), output_tok_s_ratio_vs_fp16, and the columns naming
    the FP16 row they came from (empty, scope "unpaired", when there is none)."""
    out = {"kv_ratio_vs_fp16": float("nan"), "output_tok_s_ratio_vs_fp16": float("nan"),
           "fp16_row_id": "", "fp16_run_id": "", "fp16_gpu": "", "ratio_scope": UNPAIRED}
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
    run = _text(ref.get("run_id"))
    out.update(fp16_row_id=_text(ref.get("row_id")), fp16_run_id=run, fp16_gpu=device(ref),
               ratio_scope=SAME_RUN if run == _text(row.get("run_id")) else CROSS_RUN)
    return out


def fp16_reference(row: dict, candidates: list[dict], baseline_run: str | None = None) -> dict | None:
    """The FP16 row to compare `row` with, from `candidates`: one of the same setting, on the same GPU, from the
    row's own run (or from `baseline_run` when a cross-run comparison is asked for), None when there is none.
    The same repeat wins; else the mean over that run's repeats (its row ids joined by commas)."""
    want_run = _text(baseline_run) or _text(row.get("run_id"))
    pool = [c for c in candidates if c.get("status") == "ok" and c.get("kv_dtype") in FP16_NAMES
            and _text(c.get("run_id")) == want_run and _text(c.get("gpu_name")) == _text(row.get("gpu_name"))
            and all(_same(c.get(k), row.get(k)) for k in MATCH)]
    if not pool:
        return None
    rep = [c for c in pool if _same(c.get("repeat"), row.get("repeat"))]
    if rep:
        return rep[-1]
    keys = ("kv_tokens", "kv_cache_gib", "output_tok_s")
    mean = {k: sum(as_float(c.get(k)) for c in pool) / len(pool) for k in keys}
    mean.update(row_id=",".join(_text(c.get("row_id")) for c in pool), run_id=want_run,
                gpu_name=_text(pool[0].get("gpu_name")), hf_device=_text(pool[0].get("hf_device")))
    return mean


def with_ratios(df, baseline_run: str | None = None):
    """A copy of a bench table with the ratio columns and their baseline columns recomputed row by row."""
    df = df.copy()
    rows = df.to_dict("records")
    cols: dict[str, list] = {}
    for r in rows:
        own = r.get("kv_dtype") in FP16_NAMES and r.get("status") == "ok"
        ref = r if own else fp16_reference(r, rows, baseline_run)
        for k, v in ratios(r, ref).items():
            cols.setdefault(k, []).append(v)
    for k, v in cols.items():
        df[k] = v
    return df
