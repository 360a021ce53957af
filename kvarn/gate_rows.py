"""Which bench rows `kvarn gate` judges, and how they form cells.

* The rows judged are the current ones (kvarn.results.current: the newest row of each configuration and repeat), as
  the report and bench's resume read them.
* Rows of one cell (CELL_KEYS) whose config hashes differ (a float16 and a float32 run, another engine setting)
  are different configurations: they are never pooled into one median. The configuration fields that tell them
  apart become the cell's `variant` ("model_dtype float16"), in the cell's key and label, in the results and the
  baseline alike.
"""
from __future__ import annotations

import pandas as pd

from .report.data import CELL_KEYS, bench_cells

# configuration fields that are hashed into config_hash but are not cell keys (kvarn/bench/config.py)
VARIANT_COLUMNS = ("model_dtype", "engine_args", "backend_env", "gpu_memory_utilization", "max_num_seqs",
                   "dummy_weights", "seed", "request_rate", "burstiness", "concurrency_limit", "goodput")


def _norm(v):
    if v is None:
        return None
    try:
        if pd.isna(v):
            return None
    except (TypeError, ValueError):
        pass
    if isinstance(v, str):
        return v if v.strip() else None
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return bool(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return int(f) if f.is_integer() else f


def _cell_key(rec: dict) -> tuple:
    out = []
    for k in CELL_KEYS:
        v = _norm(rec.get(k))
        out.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
    return tuple(out)


def _fmt(v) -> str:
    return "unset" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def add_variants(*frames: pd.DataFrame) -> None:
    """Set each frame's `variant` column (in place): '' where a cell holds one configuration, else the fields that
    tell its configurations apart with this row's values. The fields are chosen over all frames together, so a cell
    split in the results is split the same way in the baseline and the two still match."""
    splits: dict[tuple, list[str]] = {}
    for df in frames:
        cells: dict[tuple, list[dict]] = {}
        for rec in df.to_dict("records"):
            cells.setdefault(_cell_key(rec), []).append(rec)
        for cell, recs in cells.items():
            if len({str(r.get("config_hash")) for r in recs if _norm(r.get("config_hash")) is not None}) < 2:
                continue
            cols = [c for c in VARIANT_COLUMNS if len({repr(_norm(r.get(c))) for r in recs}) > 1]
            have = splits.setdefault(cell, [])
            have.extend(c for c in (cols or ["config_hash"]) if c not in have)
    for df in frames:
        if df.empty:
            df["variant"] = pd.Series(dtype=object)
            continue
        labels = []
        for rec in df.to_dict("records"):
            cols = splits.get(_cell_key(rec), [])
            order = [c for c in VARIANT_COLUMNS + ("config_hash",) if c in cols]
            labels.append(", ".join(f"{c} {_fmt(_norm(rec.get(c)))}" for c in order))
        df["variant"] = labels


def variant_cells(rows: pd.DataFrame) -> pd.DataFrame:
    """bench_cells of each variant apart (a variant's FP16 pairing stays within it), with the `variant` column."""
    if rows.empty:
        return pd.DataFrame()
    parts = []
    for variant, sub in rows.groupby("variant", sort=False):
        cells = bench_cells(sub.drop(columns="variant"))
        cells["variant"] = variant
        parts.append(cells)
    return pd.concat(parts, ignore_index=True, sort=False)

