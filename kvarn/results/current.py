"""Which stored bench rows are current: the one rule that `kvarn report`, `kvarn gate`, `kvarn results --table
readme` and `kvarn bench --pair-fp16`'s resume all read rows by.

A redo (a resumed failure, `kvarn bench --force`) appends a row with the same `config_hash` and `repeat`. The newest
row of each (config_hash, repeat) is current, by created_at and then store order: a failure followed by an ok retry
is superseded, and so is an ok row followed by a failed forced rerun (a broken rerun must not hide behind an older ok
row). Repeats a resumed run did not redo stay current beside the ones it did, each with the ratios of its own run.
Rows without a config hash (written before the column) are all current.
"""
from __future__ import annotations

import pandas as pd

SUPERSEDED_OK = "superseded_ok"  # column: the current row is a failure that replaced an older ok row


def current_rows(bench: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(current, superseded) rows of a bench table, each in store order. The current rows get SUPERSEDED_OK; the
    superseded ones `superseded_by`, the run id of the row that replaced them."""
    if bench.empty or "config_hash" not in bench.columns or "repeat" not in bench.columns:
        cur = bench.reset_index(drop=True).copy()
        cur[SUPERSEDED_OK] = False
        return cur, bench.iloc[0:0].assign(superseded_by=pd.Series(dtype=object))
    b = bench.reset_index(drop=True).copy()
    b["_pos"] = range(len(b))
    b["_t"] = b["created_at"].fillna("").astype(str) if "created_at" in b.columns else ""
    b = b.sort_values(["_t", "_pos"], kind="stable")
    hashed = b["config_hash"].notna() & (b["config_hash"].astype(str).str.strip() != "")
    key = pd.Series(list(zip(b["config_hash"].astype(str), b["repeat"])), index=b.index)
    newest = ~key.duplicated(keep="last") | ~hashed
    status = b["status"].astype(str) if "status" in b.columns else pd.Series("ok", index=b.index)
    ok_keys = set(key[hashed & (status == "ok")])
    runs = b["run_id"].astype(object).where(b["run_id"].notna(), "") if "run_id" in b.columns else pd.Series(
        "", index=b.index, dtype=object)
    by_run = dict(zip(key[newest & hashed], runs[newest & hashed]))

    cur = b[newest].copy()
    cur[SUPERSEDED_OK] = [k in ok_keys and s != "ok" for k, s in zip(key[newest], status[newest])]
    old = b[~newest].copy()
    old["superseded_by"] = [by_run.get(k, "") for k in key[~newest]]
    tidy = ["_pos", "_t"]
    return (cur.sort_values("_pos").drop(columns=tidy).reset_index(drop=True),
            old.sort_values("_pos").drop(columns=tidy).reset_index(drop=True))
