"""The README's results table from stored bench rows: one line per workload x candidate format, each ratio with the
FP16 row (row id, run, device) it was taken against.

A line reads the cell's current rows (kvarn.results.current, as the report and the gate do: the newest row of each
configuration and repeat) and shows the newest ok one whose ratios pair with an FP16 row of the same run (or of the
run given as `baseline_run`, then labelled cross-run); a cell with ok rows but none paired is shown as unpaired, one
with no ok row by its status. `kvarn results DIR --table readme` prints it.
"""
from __future__ import annotations

import math

import pandas as pd

from ..bench.ratios import CROSS_RUN, SAME_RUN, with_ratios
from ..formats import FP16_NAMES
from ..results.current import current_rows
from .data import format_order

WORKLOAD = ("model", "tp", "engine", "mode", "burst", "prompt_len", "output_len", "requests")


def _num(v, fmt: str) -> str:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return "–"
    return "–" if math.isnan(x) else fmt.format(x)


def _int(v) -> str:
    return _num(v, "{:,.0f}")


def workload_label(r: dict) -> str:
    model = str(r.get("model") or "").split("/")[-1]
    shape = f"{_int(r.get('requests'))} x ({_int(r.get('prompt_len'))} + {_int(r.get('output_len'))})"
    extra = [x for x in (f"TP={_int(r.get('tp'))}" if _int(r.get("tp")) not in ("1", "–") else "",
                         str(r.get("engine")) if r.get("engine") not in ("vllm", None, "") else "",
                         str(r.get("mode")) if r.get("mode") not in ("offline", None, "") else "") if x]
    return f"{model} {shape}" + (f" ({', '.join(extra)})" if extra else "")


def _key(r: dict) -> tuple:
    out = []
    for k in WORKLOAD:
        v = r.get(k)
        try:
            v = float(v)
            v = None if math.isnan(v) else v
        except (TypeError, ValueError):
            v = None if v is None else str(v)
        out.append(v)
    return tuple(out)


def readme_lines(bench: pd.DataFrame, baseline_run: str | None = None) -> list[dict]:
    """One dict per (workload, candidate): the figures, the ratios and the FP16 row they came from."""
    if bench.empty:
        return []
    rows = with_ratios(bench, baseline_run)
    by_id = {str(r.get("row_id")): r for r in rows.to_dict("records")}  # every FP16 row a ratio may name
    cells: dict[tuple, list[dict]] = {}
    for r in current_rows(rows)[0].to_dict("records"):
        if r.get("kv_dtype") in FP16_NAMES:
            continue
        cells.setdefault((_key(r), str(r.get("kv_dtype"))), []).append(r)
    order = {n: i for i, n in enumerate(format_order({k[1] for k in cells}))}
    lines = []
    for (wk, kv), rs in sorted(cells.items(), key=lambda x: (str(x[0][0]), order[x[0][1]])):
        rs = sorted(rs, key=lambda r: str(r.get("created_at") or ""))
        ok = [r for r in rs if r.get("status") == "ok"]
        paired = [r for r in ok if r.get("ratio_scope") in (SAME_RUN, CROSS_RUN)]
        pick = (paired or ok or rs)[-1]
        line = {"workload": workload_label(pick), "kv_dtype": kv, "row": pick, "status": pick.get("status"),
                "scope": pick.get("ratio_scope") if pick.get("status") == "ok" else "", "fp16": None}
        if paired:
            ids = [i for i in str(pick.get("fp16_row_id") or "").split(",") if i]
            refs = [by_id[i] for i in ids if i in by_id]
            if refs:
                line["fp16"] = {k: sum(float(x.get(k) or math.nan) for x in refs) / len(refs)
                                for k in ("output_tok_s", "kv_tokens")}
        lines.append(line)
    return lines


def readme_table(bench: pd.DataFrame, baseline_run: str | None = None) -> str:
    """The markdown table (and the note under it)."""
    lines = readme_lines(bench, baseline_run)
    if not lines:
        return "no bench rows of a candidate format (a KV format other than FP16) to tabulate"
    out = ["| workload | kv dtype | out tok/s | x FP16 tok/s | KV tokens | x FP16 KV | FP16 out tok/s, KV tokens | "
           "FP16 row · run · device |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for ln in lines:
        r = ln["row"]
        if ln["status"] != "ok":
            err = str(r.get("error") or "").replace("|", "/").strip()
            cut = (err[:120] + "…") if len(err) > 120 else err
            out.append(f"| {ln['workload']} | {ln['kv_dtype']} | {ln['status']}{': ' + cut if cut else ''} | | "
                       f"{_int(r.get('kv_tokens'))} | | | |")
            continue
        if ln["scope"] not in (SAME_RUN, CROSS_RUN):
            out.append(f"| {ln['workload']} | {ln['kv_dtype']} | {_num(r.get('output_tok_s'), '{:,.1f}')} | unpaired "
                       f"| {_int(r.get('kv_tokens'))} | unpaired | | no FP16 row of run {r.get('run_id')} |")
            continue
        f = ln["fp16"] or {}
        src = f"{r.get('fp16_row_id')} · {r.get('fp16_run_id')} · {r.get('fp16_gpu') or '?'}"
        if ln["scope"] == CROSS_RUN:
            src += f" (cross-run: the candidate is from run {r.get('run_id')})"
        out.append(f"| {ln['workload']} | {ln['kv_dtype']} | {_num(r.get('output_tok_s'), '{:,.1f}')} | "
                   f"{_num(r.get('output_tok_s_ratio_vs_fp16'), '{:.2f}x')} | {_int(r.get('kv_tokens'))} | "
                   f"{_num(r.get('kv_ratio_vs_fp16'), '{:.2f}x')} | {_num(f.get('output_tok_s'), '{:,.1f}')}, "
                   f"{_int(f.get('kv_tokens'))} | {src} |")
    cross = any(ln["scope"] == CROSS_RUN for ln in lines)
    note = ("Each ratio is against the FP16 row named on its line, measured in the same run on the same GPU"
            + ("; lines marked cross-run compare with another run's FP16 row, as asked for" if cross else "")
            + ". `kvarn results DIR --run-id RUN` lists a run's rows.")
    return "\n".join(out + ["", note])
