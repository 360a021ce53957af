"""Tables the report and the gate are built from: validated bench runs, per-cell medians, eval summaries, frontier.

A *cell* is one configuration (model, TP, engine, mode, burst, lengths, requests, kv dtype); its repeats are the raw
runs. A run is *valid* when its status is ok, every request completed and its throughput is a positive number: the
report plots medians over valid runs only and lists the others; the gate refuses to let an invalid run hide inside a
median (see kvarn/gate.py). A cell's rows are its current ones (`split_superseded`): the newest row of each
configuration and repeat, the rows the gate judges; each row's ratios are against the FP16 row of its own run.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import KvarnError
from ..formats import FP16_NAMES, REGISTRY
from ..results import ResultsStore
from ..bench.ratios import CROSS_RUN, SAME_RUN, UNPAIRED
from ..results.current import SUPERSEDED_OK, current_rows

FP16_KV = set(FP16_NAMES) | {"fp16"}
CELL_KEYS = ("model", "tp", "engine", "mode", "burst", "prompt_len", "output_len", "requests", "kv_dtype")
EVAL_KEYS = ("model", "tp", "task", "kv_dtype")
PROVENANCE = ("git_sha", "kvarn_version", "vllm", "torch", "triton", "cuda", "driver", "gpu_name", "gpu_count")
LATENCY = ("ttft", "tpot", "itl", "e2el")
HEADLINE_BURST = 16384
BENCH_PPL = "bench_ppl"  # frontier metric: the bench rows' chunked perplexity change vs fp16, in percent
RATIO_SOURCES = {"kv_ratio_vs_fp16": "kv_tokens", "output_tok_s_ratio_vs_fp16": "output_tok_s"}


def load_results(paths) -> pd.DataFrame:
    """All rows of one or more results directories (a missing or empty directory is a user error)."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    frames = []
    for p in paths:
        if not p.exists():
            raise KvarnError(f"results directory {str(p)!r} does not exist")
        store = ResultsStore(p)
        if not store.files():
            raise KvarnError(f"{str(p)!r} holds no results (expected Parquet parts under {p / 'parts'})")
        df = store.read()
        df["results_dir"] = str(p)
        frames.append(df)
    return pd.concat(frames, ignore_index=True, sort=False) if frames else pd.DataFrame()


def of_kind(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    if df.empty or "kind" not in df.columns:
        return pd.DataFrame()
    return df[df["kind"] == kind].reset_index(drop=True)


def format_order(names) -> list[str]:
    reg = list(REGISTRY)
    return sorted({str(n) for n in names}, key=lambda n: (reg.index(n) if n in reg else len(reg), n))


def family(kv_dtype: str) -> str:
    if kv_dtype in FP16_KV:
        return "fp16"
    f = REGISTRY.get(kv_dtype)
    return f.family if f else "other"


def _num(row, col) -> float:
    v = row.get(col) if hasattr(row, "get") else None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return math.nan
    return v


def invalid_reason(row) -> str | None:
    """Why one raw bench run cannot count (None when it is valid)."""
    status = str(row.get("status") or "")
    if status != "ok":
        err = str(row.get("error") or "").strip()
        return f"status {status}" + (f": {err}" if err else "")
    done, want = _num(row, "completed"), _num(row, "num_requests")
    if not math.isnan(want) and not math.isnan(done) and done < want:
        return f"only {int(done)} of {int(want)} requests completed"
    if not math.isnan(want) and math.isnan(done):
        return "completed count missing"
    tps = _num(row, "output_tok_s")
    if math.isnan(tps) or tps <= 0:
        return "no output throughput"
    return None


def normalise_bench(bench: pd.DataFrame) -> pd.DataFrame:
    b = bench.copy()
    for k in CELL_KEYS:
        if k not in b.columns:
            b[k] = np.nan
    for k in ("tp", "burst", "prompt_len", "output_len", "requests"):
        b[k] = pd.to_numeric(b[k], errors="coerce")
    for k in ("model", "engine", "mode", "kv_dtype"):
        b[k] = b[k].astype("object").where(b[k].notna(), "")
    b["invalid_reason"] = [invalid_reason(r) for r in b.to_dict("records")]
    b["valid"] = b["invalid_reason"].isna()
    return b


def split_superseded(bench: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(current, superseded) rows of a normalised bench table by the one rule the gate and bench's resume also read
    (kvarn.results.current: the newest row of each configuration and repeat, a failed rerun included). The valid
    superseded rows come back with `superseded_by` naming the run that replaced them; failed ones are in neither (the
    report lists every failed row of the input on its own)."""
    if bench.empty:
        return bench, bench.iloc[0:0]
    cur, old = current_rows(bench)
    return cur.drop(columns=SUPERSEDED_OK), old[old["valid"]].reset_index(drop=True)


def superseded_cells(bench: pd.DataFrame, superseded: pd.DataFrame) -> pd.DataFrame:
    """One cell per (configuration, run) of the superseded rows, its ratios computed as that run's own report
    would (against the FP16 cell of that run, the rows' cross-run baseline where they name one)."""
    if superseded.empty:
        return pd.DataFrame()
    out = []
    for (run, by), g in superseded.groupby(["run_id", "superseded_by"], dropna=False, sort=False):
        same_run = bench[(bench["run_id"] == run) & bench["valid"]] if "run_id" in bench else bench.iloc[0:0]
        # the run's FP16 rows still current elsewhere give its candidates their same-run ratios
        fp16 = same_run[same_run["kv_dtype"].isin(FP16_KV)]
        cells = bench_cells(pd.concat([g.drop(columns="superseded_by"), fp16], ignore_index=True))
        want = {tuple(r[k] for k in CELL_KEYS) for r in g.to_dict("records")}
        cells = cells[[tuple(r[k] for k in CELL_KEYS) in want for r in cells.to_dict("records")]]
        out.append(cells.assign(superseded_by=by))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def metric_columns(df: pd.DataFrame) -> list[str]:
    from ..results.schema import BENCH_METRICS

    return [m for m in BENCH_METRICS if m in df.columns and pd.api.types.is_numeric_dtype(df[m])]


def bench_cells(bench: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: medians over valid repeats, repeat counts, and ratios vs the FP16 cell of the same setting."""
    if bench.empty:
        return pd.DataFrame()
    b = bench if "valid" in bench.columns else normalise_bench(bench)
    keys = list(CELL_KEYS)
    metrics = metric_columns(b)
    rows = []
    for key, g in b.groupby(keys, dropna=False, sort=False):
        ok = g[g["valid"]]
        rec = dict(zip(keys, key))
        rec["runs"] = len(g)
        rec["valid_runs"] = len(ok)
        rec["invalid_runs"] = len(g) - len(ok)
        for m in metrics:
            vals = pd.to_numeric(ok[m], errors="coerce").dropna()
            rec[m] = float(vals.median()) if len(vals) else math.nan
        tps = pd.to_numeric(ok["output_tok_s"], errors="coerce").dropna() if "output_tok_s" in ok else pd.Series([])
        rec["output_tok_s_min"] = float(tps.min()) if len(tps) else math.nan
        rec["output_tok_s_max"] = float(tps.max()) if len(tps) else math.nan
        rec["output_tok_s_spread_pct"] = (float((tps.max() - tps.min()) / tps.median() * 100) if len(tps) > 1
                                          else math.nan)
        for col in PROVENANCE + ("created_at", "run_id", "hf_device", "fp16_run_id", "ratio_scope"):
            if col in g.columns:
                vals = g[col].dropna().astype(str)
                rec[col] = ", ".join(sorted(set(vals))) if len(vals) else ""
        rows.append(rec)
    cells = pd.DataFrame(rows)
    # ratios vs FP16 of the same setting, computed here when bench did not (rows older than the baseline columns):
    # only against an FP16 cell of the same run(s) on the same GPU, never across runs
    for col in ("run_id", "gpu_name"):
        if col not in cells.columns:
            cells[col] = ""
    setting = [k for k in keys if k != "kv_dtype"] + ["run_id", "gpu_name"]
    fp16 = cells[cells["kv_dtype"].isin(FP16_KV) & (cells["valid_runs"] > 0)]
    def skey(rec) -> tuple:
        return tuple(None if isinstance(rec[s], float) and math.isnan(rec[s]) else rec[s] for s in setting)

    # a stored scope stands (an unpaired row keeps no ratio); rows older than the column get a computed one
    scoped = pd.Series([bool(_scopes(r)) for r in cells.to_dict("records")], index=cells.index)
    for ratio, src in RATIO_SOURCES.items():
        if src not in cells.columns:
            continue
        base: dict[tuple, list[float]] = {}
        for rec in fp16.to_dict("records"):
            if not math.isnan(rec[src]):
                base.setdefault(skey(rec), []).append(rec[src])
        computed = []
        for rec in cells.to_dict("records"):
            den = float(np.median(base[skey(rec)])) if skey(rec) in base else math.nan
            computed.append(rec[src] / den if den and not math.isnan(den) else math.nan)
        computed = pd.Series(computed, index=cells.index, dtype=float)
        if ratio in cells.columns:
            cells[ratio] = pd.to_numeric(cells[ratio], errors="coerce").where(cells[ratio].notna() | scoped, computed)
        else:
            cells[ratio] = computed
    if "kv_cache_gib" in cells.columns:  # no KV pool (hf engine): capacity = fp16's cache bytes / the format's
        base_b = {skey(r): r["kv_cache_gib"] for r in fp16.to_dict("records") if r.get("kv_cache_gib", 0) > 0}
        by_bytes = pd.Series([base_b.get(skey(r), math.nan) / r["kv_cache_gib"] if r["kv_cache_gib"] > 0 else math.nan
                              for r in cells.to_dict("records")], index=cells.index, dtype=float)
        old = cells["kv_ratio_vs_fp16"] if "kv_ratio_vs_fp16" in cells else pd.Series(math.nan, index=cells.index)
        cells["kv_ratio_vs_fp16"] = pd.to_numeric(old, errors="coerce").where(old.notna() | scoped, by_bytes)
    cells["ratio_vs"] = [ratio_label(r) for r in cells.to_dict("records")]
    cells["family"] = cells["kv_dtype"].map(family)
    order = {n: i for i, n in enumerate(format_order(cells["kv_dtype"]))}
    cells["_o"] = cells["kv_dtype"].map(order)
    cells = cells.sort_values(["model", "tp", "mode", "burst", "_o"]).drop(columns="_o").reset_index(drop=True)
    return cells


def ratio_label(cell: dict) -> str:
    """Where a cell's ratios come from, from its rows' stored ratio_scope (as the gate reads it): 'same-run',
    'cross-run (FP16 of run X)' or 'unpaired' (no FP16 row of its run). Rows older than the column count as same-run
    where the cell's ratio could be computed (only ever against the same run), else unpaired."""
    if cell.get("kv_dtype") in FP16_KV:
        return SAME_RUN
    scopes = _scopes(cell)
    if CROSS_RUN in scopes:
        return f"{CROSS_RUN} (FP16 of run {cell.get('fp16_run_id') or '?'})"
    if SAME_RUN in scopes:
        return SAME_RUN
    ratio = cell.get("kv_ratio_vs_fp16")
    if UNPAIRED in scopes or ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return UNPAIRED
    return SAME_RUN


def _scopes(cell: dict) -> set[str]:
    return {s.strip() for s in str(cell.get("ratio_scope") or "").split(",") if s.strip()}


def eval_summary(evals: pd.DataFrame) -> pd.DataFrame:
    """Latest ok eval row per (model, TP, task, kv dtype); failed ones are reported separately."""
    if evals.empty:
        return pd.DataFrame()
    e = evals.copy()
    for k in EVAL_KEYS:
        if k not in e.columns:
            e[k] = np.nan
    e["tp"] = pd.to_numeric(e["tp"], errors="coerce").fillna(1).astype(int)
    e = e[e["status"] == "ok"]
    if e.empty:
        return pd.DataFrame()
    if "created_at" in e.columns:
        e = e.sort_values("created_at")
    e = e.groupby(list(EVAL_KEYS), dropna=False, sort=False).tail(1)
    e = e.copy()
    e["family"] = e["kv_dtype"].map(family)
    order = {n: i for i, n in enumerate(format_order(e["kv_dtype"]))}
    e["_o"] = e["kv_dtype"].map(order)
    return e.sort_values(["model", "tp", "task", "_o"]).drop(columns="_o").reset_index(drop=True)


def task_metric(ev: pd.DataFrame, task: str) -> str:
    """'accuracy' or 'ppl' for a task (whichever it reports)."""
    t = ev[ev["task"] == task]
    if "accuracy" in t.columns and t["accuracy"].notna().any():
        return "accuracy"
    return "ppl"


def pareto_mask(points: pd.DataFrame, cols: list[str]) -> pd.Series:
    """True where no other point is >= in every column and > in one (all columns: higher is better; NaN -> -inf)."""
    vals = points[cols].astype(float).fillna(-np.inf).to_numpy()
    mask = []
    for i in range(len(vals)):
        dominated = any(np.all(vals[j] >= vals[i]) and np.any(vals[j] > vals[i]) for j in range(len(vals)) if j != i)
        mask.append(not dominated)
    return pd.Series(mask, index=points.index)


def headline_burst(cells: pd.DataFrame, model: str, tp) -> float | None:
    """The burst the frontier uses for a model x TP: 16k (the paper's headline setting) when measured with an FP16
    cell, else the largest burst with an FP16 cell (capacity matters most there)."""
    c = cells[(cells["model"] == model) & (cells["tp"] == tp) & (cells["valid_runs"] > 0)]
    if c.empty:
        return None
    with_fp16 = c[c["kv_dtype"].isin(FP16_KV)]["burst"].dropna()
    pool = with_fp16 if len(with_fp16) else c["burst"].dropna()
    if HEADLINE_BURST in set(pool):
        return float(HEADLINE_BURST)
    return float(pool.max()) if len(pool) else None


def byte_capacity(model: str, kv_dtype: str, tp: int = 1) -> float:
    """KV tokens per byte against FP16's for the model's shape, from the formats' page bytes (kvarn.capacity: layers a
    format keeps 16-bit included, per-request 16-bit buffers not); NaN when the shape or the format is unknown."""
    from ..capacity import bytes_per_token
    from ..formats import get_format
    from ..shapes import resolve_model

    try:
        shape = resolve_model(str(model))
        return bytes_per_token(shape, get_format("auto"), tp) / bytes_per_token(shape, get_format(kv_dtype), tp)
    except (KvarnError, KeyError, ValueError, ZeroDivisionError):
        return math.nan


def frontier(cells: pd.DataFrame, ev: pd.DataFrame, task: str | None, burst: int | None = None) -> pd.DataFrame:
    """Per (model, TP, kv dtype): throughput ratio (x), accuracy change (y, with interval), capacity ratio (size).

    The capacity is the bench cell's measured ratio (cap_source "vllm"; NaN for an unpaired cell), else, for a format
    without bench rows, what its bytes give the model's shape (cap_source "bytes"). `ratio_vs` says what a bench
    cell's ratios were measured against (`ratio_label`). Other columns missing from the inputs stay NaN; `pareto`
    marks formats no other format beats on every available axis.
    """
    groups: dict[tuple, dict] = {}
    if not cells.empty:
        for (model, tp), _ in cells.groupby(["model", "tp"], sort=False):
            b = burst if burst is not None else headline_burst(cells, model, tp)
            c = cells[(cells["model"] == model) & (cells["tp"] == tp) & (cells["valid_runs"] > 0)]
            if b is not None:
                c = c[c["burst"] == b]
            # one mode per panel: the offline throughput mode when both were run
            modes = list(c["mode"].unique())
            if len(modes) > 1:
                c = c[c["mode"] == ("throughput" if "throughput" in modes else modes[0])]
            for rec in c.to_dict("records"):
                groups[(model, int(tp), rec["kv_dtype"])] = {
                    "x": rec.get("output_tok_s_ratio_vs_fp16", math.nan), "cap": rec.get("kv_ratio_vs_fp16", math.nan),
                    "output_tok_s": rec.get("output_tok_s", math.nan), "kv_tokens": rec.get("kv_tokens", math.nan),
                    "kv_cache_gib": rec.get("kv_cache_gib", math.nan), "ppl": rec.get("ppl", math.nan),
                    "ppl_delta_pct": rec.get("ppl_delta_pct", math.nan), "burst": b, "mode": rec.get("mode"),
                    "hf_device": rec.get("hf_device", ""), "x_run": rec.get("run_id") or "",
                    "x_gpu": rec.get("gpu_name") or "", "ratio_vs": rec.get("ratio_vs") or "",
                    "from_bench": True}
    metric = None
    if task and not ev.empty:
        metric = task_metric(ev, task)
        for rec in ev[ev["task"] == task].to_dict("records"):
            k = (rec["model"], int(rec["tp"]), rec["kv_dtype"])
            d = groups.setdefault(k, {})
            y, lo, hi = (rec.get(c, math.nan) for c in ("delta_vs_fp16", "delta_ci_low", "delta_ci_high"))
            d["y_run"] = rec.get("run_id") or ""
            if metric == "accuracy":  # percentage points
                d.update(y=y * 100, y_lo=lo * 100, y_hi=hi * 100, value=rec.get("accuracy"))
            else:  # perplexity: plot the negated change so that up is better on every panel
                d.update(y=-y, y_lo=-hi, y_hi=-lo, value=rec.get("ppl"))
    if metric is None and any(_num(d, "ppl_delta_pct") == _num(d, "ppl_delta_pct") for d in groups.values()):
        # no eval task: the bench rows' own chunked perplexity (hf engine) is the accuracy axis, up = better
        metric = BENCH_PPL
        for d in groups.values():
            d.update(y=-_num(d, "ppl_delta_pct"), y_lo=math.nan, y_hi=math.nan, value=_num(d, "ppl"),
                     y_run=d.get("x_run", ""))
    for (model, tp, kv), d in groups.items():
        if not d.get("from_bench"):  # no bench row: the capacity the format's bytes give this model's shape
            d["cap"], d["cap_source"] = byte_capacity(model, kv, tp), "bytes"
        else:  # measured; an unpaired cell keeps no ratio rather than one from the format's bytes
            d["cap_source"] = "vllm"
    rows = [{"model": k[0], "tp": k[1], "kv_dtype": k[2], **v} for k, v in groups.items()]
    if not rows:
        return pd.DataFrame()
    f = pd.DataFrame(rows).drop(columns="from_bench", errors="ignore")
    for c in ("x", "y", "y_lo", "y_hi", "cap"):
        if c not in f.columns:
            f[c] = math.nan
    for c in ("x_run", "x_gpu", "y_run", "hf_device", "ratio_vs"):
        f[c] = f[c].fillna("") if c in f.columns else ""
    f["metric"] = metric
    f["family"] = f["kv_dtype"].map(family)
    f["pareto"] = False
    for _, g in f.groupby(["model", "tp"], sort=False):
        axes = [c for c in ("x", "y", "cap") if g[c].notna().any()]
        if axes:
            f.loc[g.index, "pareto"] = pareto_mask(g, axes)
    f.loc[f["ratio_vs"] == UNPAIRED, "pareto"] = False  # no ratio to be optimal on
    order = {n: i for i, n in enumerate(format_order(f["kv_dtype"]))}
    f["_o"] = f["kv_dtype"].map(order)
    return f.sort_values(["model", "tp", "_o"]).drop(columns="_o").reset_index(drop=True)
