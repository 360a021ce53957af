"""`kvarn report`: one self-contained HTML page (figures embedded, no network) plus the PNGs and a Markdown summary.

Layout of OUT/: index.html, frontier[_TASK].png, capacity.png, throughput_vs_burst.png, latency.png, accuracy.png
(each only when its data exists), summary.md (headline table for a PR comment), report.json (what was rendered,
what was missing).
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..errors import KvarnError
from . import plots
from .fixtures import DEMO_RUN_ID
from .data import (FP16_KV, PROVENANCE, bench_cells, eval_summary, format_order, frontier, load_results,
                   normalise_bench, of_kind, split_superseded, superseded_cells, task_metric)
from .scope import BYTES, CROSS_RUN, frontier_note, ratio_text, ratios_sentence


@dataclass
class Report:
    out: Path
    html: Path
    pngs: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=dict)


def _fmt(v, nd=2, pct=False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or (not isinstance(v, str) and pd.isna(v)):
        return "–"
    if isinstance(v, str):
        return v
    if pct:
        return f"{v * 100:+.{nd}f}"
    if isinstance(v, (int,)) or (isinstance(v, float) and v.is_integer() and abs(v) >= 100):
        return f"{int(v):,}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_") or "task"


def _table(df: pd.DataFrame, cols: list[tuple[str, str]], formatters: dict | None = None, cls: str = "") -> str:
    formatters = formatters or {}
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    body = []
    for rec in df.to_dict("records"):
        tds = []
        for c, _ in cols:
            v = rec.get(c)
            s = formatters[c](rec) if c in formatters else _fmt(v)
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            tds.append(f'<td class="{"n" if num else ""}">{html.escape(str(s))}</td>')
        body.append("<tr>" + "".join(tds) + "</tr>")
    return (f'<div class="tw"><table class="sortable {cls}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
main{max-width:1320px;margin:0 auto;padding:20px 28px 60px}
h1{font-size:26px;margin:8px 0 4px} h2{font-size:20px;margin:34px 0 10px;border-bottom:2px solid #ddd;padding-bottom:4px}
h3{font-size:16px;margin:20px 0 8px}
.meta{color:#555;font-size:14px;line-height:1.6}
.notes{background:#fff7e0;border:1px solid #f0c36d;border-radius:6px;padding:10px 16px;margin:16px 0;font-size:14px}
.notes li{margin:3px 0}
.ok{background:#eef8ee;border-color:#9fd49f}
figure{margin:14px 0 22px;background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:10px}
figure img{max-width:100%;height:auto;display:block;margin:0 auto}
figcaption{font-size:13px;color:#555;margin-top:6px}
.tw{overflow-x:auto;background:#fff;border:1px solid #e3e3e3;border-radius:6px;margin:8px 0 18px}
table{border-collapse:collapse;font-size:13px;width:100%}
th,td{padding:5px 9px;border-bottom:1px solid #eee;white-space:nowrap;text-align:left}
th{background:#f0f0f3;position:sticky;top:0;cursor:pointer;font-weight:600}
td.n{text-align:right;font-variant-numeric:tabular-nums}
tbody tr:nth-child(even){background:#fafafc}
.pareto{font-weight:700;color:#0a7d32}
.bad{color:#b00020}
nav a{margin-right:14px;font-size:14px}
code{background:#f0f0f3;padding:1px 4px;border-radius:3px}
"""
JS = """
document.querySelectorAll('table.sortable th').forEach(function(th){th.addEventListener('click',function(){
var t=th.closest('table'),b=t.tBodies[0],i=Array.prototype.indexOf.call(th.parentNode.children,th),
d=th.dataset.d==='1'?-1:1;th.dataset.d=d===1?'1':'0';
var v=function(r){var s=r.children[i].textContent.replace(/[,×%+]/g,'');var n=parseFloat(s);return isNaN(n)?s:n;};
Array.from(b.rows).sort(function(x,y){var a=v(x),c=v(y);return (a>c?1:a<c?-1:0)*d;}).forEach(function(r){b.appendChild(r);});
});});
"""


def _img(path: Path | None, caption: str) -> str:
    if path is None:
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f'<figcaption>{html.escape(caption)} (<a href="{html.escape(path.name)}">{html.escape(path.name)}</a>)'
            f'</figcaption></figure>')


def _ci(rec, lo, hi, scale=100.0, nd=1) -> str:
    a, b = rec.get(lo), rec.get(hi)
    if a is None or b is None or pd.isna(a) or pd.isna(b):
        return "–"
    return f"[{a * scale:+.{nd}f}, {b * scale:+.{nd}f}]"


def build_report(results, out: str | Path, *, task: str | None = None, burst: int | None = None,
                 title: str | None = None, allowed_drop_pp: float | None = None,
                 illustrative: bool = False) -> Report:
    df = load_results(results)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvarnError(f"cannot create report directory {out}: {e}") from None
    for old in out.glob("*.png"):  # a re-render must not leave figures of an earlier run beside the new page
        old.unlink()

    # rows `kvarn report --demo` wrote are illustrative wherever they are rendered from
    illustrative = illustrative or bool("run_id" in df and len(df) and (df["run_id"] == DEMO_RUN_ID).all())
    bench_raw = of_kind(df, "bench")
    eval_raw = of_kind(df, "eval")
    bench_all = normalise_bench(bench_raw) if not bench_raw.empty else pd.DataFrame()
    bench, superseded = split_superseded(bench_all) if not bench_all.empty else (bench_all, bench_all)
    cells = bench_cells(bench) if not bench.empty else pd.DataFrame()
    old_cells = superseded_cells(bench, superseded) if not bench.empty else pd.DataFrame()
    ev = eval_summary(eval_raw) if not eval_raw.empty else pd.DataFrame()
    notes: list[str] = []
    if bench.empty and ev.empty:
        raise KvarnError(f"{results} has no bench or eval rows (kinds present: "
                         f"{', '.join(sorted(set(df.get('kind', pd.Series(dtype=str)).dropna()))) or 'none'})")
    if bench.empty:
        notes.append("No bench rows: throughput and latency are unavailable (run `kvarn bench`); the frontier's KV "
                     "capacity is what the formats' bytes give each model's shape, not a measured pool.")
    bench_ppl = not cells.empty and "ppl_delta_pct" in cells and cells["ppl_delta_pct"].notna().any()
    if eval_raw.empty and bench_ppl:
        notes.append("No eval rows: the frontier's accuracy axis is the bench rows' own chunked perplexity (a short "
                     "Moby-Dick window through each format); `kvarn eval` measures task accuracy.")
    elif eval_raw.empty:
        notes.append("No eval rows: accuracy axis unavailable; the frontier plots KV capacity against throughput "
                     "instead (run `kvarn eval`).")
    elif ev.empty:
        notes.append("Every eval row failed: accuracy axis unavailable (see Failed runs).")
    if burst is not None and not cells.empty and burst not in set(cells["burst"].dropna().astype(int)):
        raise KvarnError(f"--burst {burst} is not in the results; measured: "
                         f"{', '.join(str(int(b)) for b in sorted(cells['burst'].dropna().unique()))}")

    # --- which tasks: the accuracy ones first, then perplexity ---------------------------------------------------
    tasks: list[str] = []
    if task and ev.empty:
        raise KvarnError(f"--task {task!r}: every eval row in {results} failed, so there is no accuracy to plot"
                         if not eval_raw.empty else
                         f"--task {task!r}: {results} has no eval rows (measure one with `kvarn eval {task}`)")
    if not ev.empty:
        all_tasks = list(dict.fromkeys(ev["task"]))
        if task:
            if task not in all_tasks:
                raise KvarnError(f"--task {task!r} has no eval rows; present: {', '.join(all_tasks)}")
            tasks = [task]
        else:
            tasks = sorted(all_tasks, key=lambda t: task_metric(ev, t) != "accuracy")
        for t in all_tasks:
            e = ev[ev["task"] == t]
            for (model, tp), g in e.groupby(["model", "tp"], sort=False):
                if not g["kv_dtype"].isin(FP16_KV).any():
                    notes.append(f"{t} on {model} TP={tp}: no fp16 eval row; changes vs fp16 come from the eval "
                                 "rows' own delta columns only.")
                if "delta_vs_fp16" not in g or g["delta_vs_fp16"].isna().all():
                    notes.append(f"{t} on {model} TP={tp}: no paired change vs fp16 recorded; nothing to plot.")
    if not cells.empty:
        for (model, tp), g in cells.groupby(["model", "tp"], sort=False):
            if not (g["kv_dtype"].isin(FP16_KV) & (g["valid_runs"] > 0)).any():
                notes.append(f"{model} TP={int(tp)}: no valid fp16 bench cell; ratios vs fp16 use the rows' own "
                             "ratio columns where present.")
            if g["burst"].nunique() < 2:
                notes.append(f"{model} TP={int(tp)}: one burst context only; throughput vs burst has one point "
                             "per format.")
        if "hf_device" in bench_all and (bench_all["hf_device"].astype(str) == "cpu").any():
            notes.append("Some bench rows ran on the CPU (transformers, hf engine): their throughput is CPU-measured "
                         "and not representative of a GPU; their KV capacity is the caches' real bytes.")
        lat = [c for c in cells.columns if c.endswith("_ms_p50")]
        if not lat or cells[lat].isna().all().all():
            notes.append("No latency percentiles (only `serve` mode records TTFT/TPOT/ITL/E2EL).")
    invalid = bench_all[~bench_all["valid"]] if not bench_all.empty else pd.DataFrame()
    failed_eval = eval_raw[eval_raw["status"] != "ok"] if not eval_raw.empty else pd.DataFrame()
    if len(invalid):
        notes.append(f"{len(invalid)} bench run(s) failed or did not complete every request: listed under "
                     "Failed runs, not plotted, not in any median.")
    if len(failed_eval):
        notes.append(f"{len(failed_eval)} eval row(s) failed: listed under Failed runs, not plotted.")
    if len(old_cells):
        notes.append(f"{len(old_cells)} bench cell(s) of an older run were measured again by a newer run: listed "
                     "under Superseded runs, not in the headline, the figures or any median.")
    if not cells.empty and not ev.empty:
        bk = set(zip(cells["model"], cells["tp"].astype(int), cells["kv_dtype"]))
        ek = set(zip(ev["model"], ev["tp"].astype(int), ev["kv_dtype"]))
        for m, t, k in sorted(bk - ek):
            notes.append(f"{k} on {m} TP={t}: bench rows but no eval rows (no accuracy point).")
        for m, t, k in sorted(ek - bk):
            notes.append(f"{k} on {m} TP={t}: eval rows but no bench rows (no throughput or capacity).")
    for col, what in (("gpu_name", "GPU types"), ("vllm", "vLLM versions")):
        if col in df.columns:
            vals = sorted(set(df[col].dropna().astype(str)) - {"", "None"})
            if len(vals) > 1:
                notes.append(f"Rows come from {len(vals)} {what} ({', '.join(vals)}): compare with care.")

    # --- figures ---------------------------------------------------------------------------------------------------
    pngs: list[Path] = []
    figs_html: list[str] = []
    sub = "illustrative fixture data, not measurements" if illustrative else ""
    fronts: dict[str, pd.DataFrame] = {}
    for i, t in enumerate(tasks or [None]):
        f = frontier(cells, ev, t, burst)
        if t is not None:
            f = f[f["y"].notna()] if not f.empty else f
        fronts[t or ""] = f
        name = "frontier.png" if i == 0 else f"frontier_{_slug(t)}.png"
        p = plots.frontier_png(f, out / name, task=t, subtitle=sub,
                               allowed_drop_pp=allowed_drop_pp if t and task_metric(ev, t) == "accuracy" else None)
        if p:
            pngs.append(p)
            if t and not f["x"].notna().any():
                cap = (f"Frontier for {t}: accuracy change vs fp16 (paired interval) against the KV capacity ÷ fp16 "
                       "that the formats' bytes give the model (no bench rows); black ring = Pareto-optimal.")
            elif t:
                cap = (f"Frontier for {t}: accuracy change vs fp16 (paired interval) against output tokens/s ÷ fp16 "
                       "at the headline burst; marker area = KV capacity ÷ fp16; black ring = Pareto-optimal.")
            elif bench_ppl:
                cap = ("Frontier: chunked perplexity change vs fp16 (the bench rows' own, up = better) against output "
                       "tokens/s ÷ fp16; marker area = KV capacity ÷ fp16; black ring = Pareto-optimal.")
            else:
                cap = "Throughput ratio vs KV capacity ratio at the headline burst; black ring = Pareto-optimal."
            figs_html.append(_img(p, cap + frontier_note(f)))
    for fn, name, cap, what in (
        (lambda: plots.capacity_png(cells, out / "capacity.png"), "capacity",
         "KV capacity per format vs fp16 (a bar labelled cross-run: against another run's FP16 cell)."
         if cells.get("ratio_vs", pd.Series(dtype=str)).astype(str).str.startswith(CROSS_RUN).any()
         else "KV capacity per format vs the fp16 cell of the same run.", None),
        (lambda: plots.throughput_png(cells, out / "throughput_vs_burst.png"), "throughput",
         "Output tokens/s against burst context.", None),
        (lambda: plots.latency_png(cells, out / "latency.png"), "latency", "Latency percentiles at the headline burst.",
         None),
        (lambda: plots.accuracy_png(ev, out / "accuracy.png"), "accuracy",
         "Accuracy change vs fp16 per task with paired intervals.", None),
    ):
        p = fn() if (name == "accuracy" and not ev.empty) or (name != "accuracy" and not cells.empty) else None
        if p:
            pngs.append(p)
            figs_html.append(_img(p, cap))

    # --- headline table -----------------------------------------------------------------------------------------------
    head_rows = _headline(cells, ev, fronts, tasks, burst)
    models = sorted(set(cells.get("model", pd.Series(dtype=str))) | set(ev.get("model", pd.Series(dtype=str))))
    formats = format_order(set(cells.get("kv_dtype", pd.Series(dtype=str))) | set(ev.get("kv_dtype", pd.Series(dtype=str))))

    page = _page(df, cells, old_cells, bench_all, ev, invalid, failed_eval, head_rows, tasks, figs_html, notes,
                 models, formats, title or "kvarn report", results, illustrative)
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    (out / "summary.md").write_text(_markdown(head_rows, tasks, notes, illustrative), encoding="utf-8")
    rep = Report(out, index, pngs, notes, models, formats,
                 {"bench_rows": len(bench_all), "eval_rows": len(eval_raw), "cells": len(cells),
                  "superseded_cells": len(old_cells),
                  "invalid_bench_runs": len(invalid), "failed_eval_rows": len(failed_eval)})
    (out / "report.json").write_text(json.dumps({
        "results": [str(r) for r in ([results] if isinstance(results, (str, Path)) else results)],
        "html": index.name, "pngs": [p.name for p in pngs], "notes": notes, "models": models, "formats": formats,
        "counts": rep.counts, "illustrative": illustrative,
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}, indent=2))
    return rep


def _headline(cells, ev, fronts, tasks, burst) -> pd.DataFrame:
    rows: dict[tuple, dict] = {}
    base = fronts.get(tasks[0] if tasks else "", pd.DataFrame())
    f0 = frontier(cells, pd.DataFrame(), None, burst) if not cells.empty else pd.DataFrame()
    for rec in f0.to_dict("records") if not f0.empty else []:
        rows[(rec["model"], rec["tp"], rec["kv_dtype"])] = {
            "model": rec["model"], "tp": rec["tp"], "kv_dtype": rec["kv_dtype"], "burst": rec.get("burst"),
            "kv_ratio": rec["cap"], "tok_ratio": rec["x"], "output_tok_s": rec.get("output_tok_s"),
            "kv_tokens": rec.get("kv_tokens"), "kv_mib": _mib(rec.get("kv_cache_gib")),
            "ppl_delta_pct": rec.get("ppl_delta_pct"), "hf_device": rec.get("hf_device"),
            "ratio_vs": rec.get("ratio_vs") or (BYTES if rec.get("cap_source") == "bytes" else "")}
    for t in tasks:
        for rec in ev[ev["task"] == t].to_dict("records"):
            k = (rec["model"], int(rec["tp"]), rec["kv_dtype"])
            r = rows.setdefault(k, {"model": k[0], "tp": k[1], "kv_dtype": k[2]})
            m = task_metric(ev, t)
            scale = 100.0 if m == "accuracy" else 1.0
            r[f"{t}"] = rec.get(m)
            d = rec.get("delta_vs_fp16")
            r[f"{t}_delta"] = None if d is None or pd.isna(d) else d * scale
            r[f"{t}_ci"] = _ci(rec, "delta_ci_low", "delta_ci_high", scale, 1 if m == "accuracy" else 3)
            r[f"{t}_metric"] = m
    if not rows:
        return pd.DataFrame()
    h = pd.DataFrame(list(rows.values()))
    h["pareto"] = False
    if not base.empty:
        par = {(r["model"], r["tp"], r["kv_dtype"]) for r in base.to_dict("records") if r["pareto"]}
        h["pareto"] = [(r["model"], r["tp"], r["kv_dtype"]) in par for r in h.to_dict("records")]
    order = {n: i for i, n in enumerate(format_order(h["kv_dtype"]))}
    h["_o"] = h["kv_dtype"].map(order)
    return h.sort_values(["model", "tp", "_o"]).drop(columns="_o").reset_index(drop=True)


def _mib(gib) -> float:
    try:
        return float(gib) * 1024
    except (TypeError, ValueError):
        return math.nan


def _any(h: pd.DataFrame, col: str) -> bool:
    return col in h and pd.to_numeric(h[col], errors="coerce").notna().any()


def _headline_cols(h: pd.DataFrame, tasks) -> tuple[list, dict]:
    cols = [("model", "model"), ("tp", "TP"), ("kv_dtype", "kv dtype")]
    fm = {"tp": lambda r: str(int(r["tp"])), "kv_dtype": lambda r: plots.label(r["kv_dtype"])}
    if "kv_ratio" in h:
        # capacity as the rows measured it: KV tokens (vLLM's pool), else the cache's bytes (hf engine)
        kv = [("kv_tokens", "KV tokens")] if _any(h, "kv_tokens") else []
        kv += [("kv_mib", "KV cache MiB")] if not kv and _any(h, "kv_mib") else []
        cpu = "hf_device" in h and (h["hf_device"].astype(str) == "cpu").any()
        cols += [("burst", "burst"), *kv, ("kv_ratio", "KV ÷ fp16"),
                 ("output_tok_s", "CPU out tok/s" if cpu else "out tok/s"), ("tok_ratio", "tok/s ÷ fp16"),
                 ("ratio_vs", "ratios vs")]
        if _any(h, "ppl_delta_pct"):
            cols.append(("ppl_delta_pct", "ppl Δ % vs fp16"))
            fm["ppl_delta_pct"] = lambda r: "–" if pd.isna(r.get("ppl_delta_pct")) else f"{r['ppl_delta_pct']:+.2f}"
        fm.update(burst=lambda r: plots.burst_label(r.get("burst")),
                  kv_ratio=lambda r: ratio_text(r.get("kv_ratio"), r.get("ratio_vs")),
                  tok_ratio=lambda r: ratio_text(r.get("tok_ratio"), r.get("ratio_vs")),
                  ratio_vs=lambda r: r.get("ratio_vs") or "–")
    for t in tasks:
        if t not in h:
            continue
        m = h[f"{t}_metric"].dropna().iloc[0] if h[f"{t}_metric"].notna().any() else "accuracy"
        unit = "pp" if m == "accuracy" else "Δppl"
        cols += [(t, f"{t} {'acc %' if m == 'accuracy' else 'ppl'}"), (f"{t}_delta", f"Δ {unit}"),
                 (f"{t}_ci", "Δ interval")]
        fm[t] = (lambda r, t=t, m=m: "–" if pd.isna(r.get(t)) else (f"{r[t] * 100:.1f}" if m == "accuracy"
                                                                     else f"{r[t]:.3f}"))
        fm[f"{t}_delta"] = lambda r, t=t: "–" if pd.isna(r.get(f"{t}_delta")) else f"{r[f'{t}_delta']:+.2f}"
        fm[f"{t}_ci"] = lambda r, t=t: r.get(f"{t}_ci") if isinstance(r.get(f"{t}_ci"), str) else "–"
    cols.append(("pareto", "Pareto"))
    fm["pareto"] = lambda r: "✓" if r.get("pareto") else ""
    return cols, fm


def _page(df, cells, old_cells, bench, ev, invalid, failed_eval, head, tasks, figs, notes, models, formats, title,
          results, illustrative) -> str:
    e = html.escape
    created = sorted(df["created_at"].dropna().astype(str)) if "created_at" in df else []
    prov = {c: sorted(set(df[c].dropna().astype(str)) - {"", "None"}) for c in PROVENANCE if c in df.columns}
    meta = [f"<b>results</b>: {e(', '.join(map(str, [results] if isinstance(results, (str, Path)) else results)))}",
            f"<b>models</b>: {e(', '.join(models))}", f"<b>formats</b>: {e(', '.join(formats))}",
            f"<b>rows</b>: {len(bench)} bench runs in {len(cells)} cells"
            + (f" (and {len(old_cells)} superseded)" if len(old_cells) else "") + f", {len(ev)} eval summaries",
            f"<b>measured</b>: {e(created[0][:19]) + ' → ' + e(created[-1][:19]) if created else '–'} (UTC)",
            "<b>versions</b>: " + e("; ".join(f"{k} {', '.join(v)}" for k, v in prov.items()
                                            if k in ('vllm', 'torch', 'kvarn_version', 'cuda', 'driver') and v)),
            "<b>GPU</b>: " + e(_gpu_line(df, prov)),
            "<b>git</b>: " + e(", ".join(prov.get("git_sha", [])) or "not recorded")]
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<meta name='viewport' content='width=device-width,initial-scale=1'><style>{CSS}</style></head><body><main>",
             f"<h1>{e(title)}</h1>"]
    if illustrative:
        parts.append("<div class='notes'><b>Illustrative fixture data</b>: these numbers were generated for a demo, "
                     "they are not measurements.</div>")
    parts.append("<div class='meta'>" + "<br>".join(meta) + "</div>")
    parts.append("<nav><a href='#headline'>Headline</a><a href='#figures'>Figures</a><a href='#bench'>Bench cells</a>"
                 "<a href='#eval'>Eval</a><a href='#failed'>Failed runs</a><a href='#superseded'>Superseded runs</a>"
                 "<a href='#prov'>Provenance</a></nav>")
    if notes:
        parts.append("<div class='notes'><b>Missing or notable</b><ul>" + "".join(f"<li>{e(n)}</li>" for n in notes)
                     + "</ul></div>")
    else:
        parts.append("<div class='notes ok'>Bench and eval rows present for every format; no failed runs.</div>")
    parts.append("<h2 id='headline'>Headline</h2>")
    if not head.empty:
        cols, fm = _headline_cols(head, tasks)
        parts.append(f"<p class='meta'>{e(_headline_caption(head))}</p>")
        parts.append(_table(head, cols, fm))
    parts.append("<h2 id='figures'>Figures</h2>" + ("".join(figs) or "<p>No figures: no plottable rows.</p>"))

    parts.append("<h2 id='bench'>Bench cells (medians over valid repeats)</h2>")
    parts.append("<p>No bench rows.</p>" if cells.empty else _cells_table(cells))

    parts.append("<h2 id='eval'>Eval summaries</h2>")
    if ev.empty:
        parts.append("<p>No eval rows: accuracy axis unavailable.</p>")
    else:
        evd = ev.copy()
        for c in ("n", "accuracy", "ppl", "ci_low", "ci_high", "delta_vs_fp16", "delta_ci_low", "delta_ci_high",
                  "truncation_rate", "mean_gen_tokens", "samples"):
            if c not in evd:
                evd[c] = math.nan
        cols = [("task", "task"), ("model", "model"), ("tp", "TP"), ("kv_dtype", "kv dtype"), ("n", "n"),
                ("samples", "samples"), ("accuracy", "accuracy %"), ("acc_ci", "95% interval"), ("ppl", "ppl"),
                ("delta_vs_fp16", "Δ vs fp16"), ("d_ci", "paired Δ interval"), ("truncation_rate", "truncated %"),
                ("mean_gen_tokens", "mean gen tokens"), ("git_sha", "git"), ("vllm", "vLLM"), ("gpu_name", "GPU"),
                ("created_at", "date")]
        evd["acc_ci"] = [_ci(r, "ci_low", "ci_high", 100.0) if pd.notna(r.get("accuracy")) else
                         _ci(r, "ci_low", "ci_high", 1.0, 3) for r in evd.to_dict("records")]
        evd["d_ci"] = [_ci(r, "delta_ci_low", "delta_ci_high", 100.0) if pd.notna(r.get("accuracy")) else
                       _ci(r, "delta_ci_low", "delta_ci_high", 1.0, 3) for r in evd.to_dict("records")]
        fm = {"accuracy": lambda r: "–" if pd.isna(r["accuracy"]) else f"{r['accuracy'] * 100:.1f}",
              "delta_vs_fp16": lambda r: "–" if pd.isna(r["delta_vs_fp16"]) else (
                  f"{r['delta_vs_fp16'] * 100:+.2f} pp" if pd.notna(r["accuracy"]) else f"{r['delta_vs_fp16']:+.3f}"),
              "truncation_rate": lambda r: "–" if pd.isna(r["truncation_rate"]) else f"{r['truncation_rate'] * 100:.1f}",
              "n": lambda r: "–" if pd.isna(r["n"]) else str(int(r["n"])),
              "samples": lambda r: "–" if pd.isna(r["samples"]) else str(int(r["samples"])),
              "tp": lambda r: str(int(r["tp"])), "kv_dtype": lambda r: plots.label(r["kv_dtype"]),
              "created_at": lambda r: str(r.get("created_at") or "")[:19]}
        parts.append(_table(evd, cols, fm))

    parts.append("<h2 id='failed'>Failed runs (listed, not plotted)</h2>")
    if invalid.empty and failed_eval.empty:
        parts.append("<p>None.</p>")
    else:
        rows = []
        for r in invalid.to_dict("records") if not invalid.empty else []:
            rows.append({"kind": "bench", "model": r.get("model"), "tp": r.get("tp"), "kv_dtype": r.get("kv_dtype"),
                         "setting": f"{r.get('mode') or ''} burst {plots.burst_label(r.get('burst'))}",
                         "repeat": r.get("repeat"), "status": r.get("status"), "reason": r.get("invalid_reason"),
                         "run_id": r.get("run_id"), "created_at": str(r.get("created_at") or "")[:19]})
        for r in failed_eval.to_dict("records") if not failed_eval.empty else []:
            rows.append({"kind": "eval", "model": r.get("model"), "tp": r.get("tp"), "kv_dtype": r.get("kv_dtype"),
                         "setting": f"task {r.get('task')}", "repeat": r.get("repeat"), "status": r.get("status"),
                         "reason": r.get("error") or "", "run_id": r.get("run_id"),
                         "created_at": str(r.get("created_at") or "")[:19]})
        fdf = pd.DataFrame(rows)
        parts.append(_table(fdf, [(c, c) for c in ("kind", "model", "tp", "kv_dtype", "setting", "repeat", "status",
                                                   "reason", "run_id", "created_at")],
                            {"tp": lambda r: str(int(r["tp"])) if pd.notna(r["tp"]) else "–",
                             "repeat": lambda r: str(int(r["repeat"])) if pd.notna(r["repeat"]) else "–"},
                            cls="bad"))

    parts.append("<h2 id='superseded'>Superseded runs (listed, not plotted, in no median)</h2>")
    if old_cells.empty:
        parts.append("<p>None: every configuration was measured by one run.</p>")
    else:
        parts.append("<p class='meta'>Configurations a newer run measured again; each line is one older run's "
                     "repeats with that run's own ratios.</p>")
        parts.append(_cells_table(old_cells, [("superseded_by", "superseded by run")]))

    parts.append("<h2 id='prov'>Provenance</h2>")
    pcols = [c for c in ("run_id", "kind") + PROVENANCE + ("python", "transformers") if c in df.columns]
    if pcols and "run_id" in df.columns:
        d = df.copy()
        for c in pcols:
            d[c] = d[c].astype("object").where(d[c].notna(), "").astype(str)
        g = d.groupby(pcols, dropna=False).agg(rows=("kind", "size"), first=("created_at", "min"),
                                               last=("created_at", "max")).reset_index()
        parts.append(_table(g, [(c, c) for c in pcols] + [("rows", "rows"), ("first", "first row (UTC)"),
                                                          ("last", "last row (UTC)")],
                            {"first": lambda r: str(r["first"])[:19], "last": lambda r: str(r["last"])[:19]}))
    parts.append(f"<p class='meta'>Generated {e(_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds'))} "
                 "by <code>kvarn report</code>. Self-contained: figures are embedded; PNGs sit beside this file.</p>")
    parts.append(f"</main><script>{JS}</script></body></html>")
    return "\n".join(parts)


def _cells_table(cells: pd.DataFrame, extra=()) -> str:
    """The Bench cells table (one line per configuration and run), with `extra` columns at the end."""
    cols = [("model", "model"), ("tp", "TP"), ("mode", "mode"), ("burst", "burst"), ("prompt_len", "prompt"),
            ("output_len", "output"), ("requests", "reqs"), ("kv_dtype", "kv dtype"), ("run_id", "run"),
            ("valid_runs", "valid"), ("runs", "runs"), ("output_tok_s", "out tok/s"),
            ("output_tok_s_spread_pct", "spread %"), ("output_tok_s_ratio_vs_fp16", "÷ fp16"),
            ("total_tok_s", "total tok/s"), ("request_throughput", "req/s"), ("kv_tokens", "KV tokens"),
            ("kv_ratio_vs_fp16", "KV ÷ fp16"), ("ratio_vs", "ratios vs"), ("max_concurrency", "max conc.")]
    for k in ("ttft", "tpot", "itl", "e2el"):
        for p in ("p50", "p90", "p99"):
            c = f"{k}_ms_{p}"
            if c in cells and cells[c].notna().any():
                cols.append((c, f"{k.upper()} {p} ms"))
    cols += [(c, c) for c in ("preemptions", "gpu_mem_gib") if c in cells and cells[c].notna().any()]
    if _any(cells, "kv_cache_gib") and not _any(cells, "kv_tokens"):  # hf rows: capacity as real bytes
        cells = cells.assign(kv_mib=[_mib(v) for v in cells["kv_cache_gib"]])
        cols = [("kv_mib", "KV cache MiB") if c == "kv_tokens" else (c, h) for c, h in cols]
    if _any(cells, "ppl_delta_pct"):
        cols += [("ppl", "ppl"), ("ppl_delta_pct", "ppl Δ % vs fp16")]
    cols += [("git_sha", "git"), ("vllm", "vLLM"), ("gpu_name", "GPU"), *extra]

    def as_int(c):
        return lambda r: f"{int(r[c]):,}" if pd.notna(r.get(c)) else "–"

    def ratio(c):
        return lambda r: ratio_text(r.get(c), r.get("ratio_vs"))

    fm = {"tp": lambda r: str(int(r["tp"])) if pd.notna(r["tp"]) else "–",
          **{c: as_int(c) for c in ("prompt_len", "output_len", "requests", "valid_runs", "runs", "kv_tokens")},
          **{c: ratio(c) for c in ("output_tok_s_ratio_vs_fp16", "kv_ratio_vs_fp16")},
          "burst": lambda r: plots.burst_label(r.get("burst")),
          "kv_dtype": lambda r: plots.label(r["kv_dtype"])}
    return _table(cells, cols, fm)


def _headline_caption(head: pd.DataFrame) -> str:
    return ("Per model × TP at the headline burst (16k when measured). "
            + ratios_sentence(head.get("ratio_vs", pd.Series(dtype=str)))
            + " Δ is the paired change vs fp16 with its interval.")


def _gpu_line(df: pd.DataFrame, prov: dict) -> str:
    """The GPUs the rows name, in words where none is recorded (CPU rows, older rows)."""
    names = prov.get("gpu_name", [])
    counts = [c for c in prov.get("gpu_count", []) if c not in ("0", "0.0")]
    if names:
        return ", ".join(names) + (f" × {', '.join(c.removesuffix('.0') for c in counts)}" if counts else "")
    if "hf_device" in df and (df["hf_device"].astype(str) == "cpu").any():
        return "none (rows measured on the CPU through transformers; their throughput says nothing about a GPU)"
    return "not recorded in the rows"


def _markdown(head: pd.DataFrame, tasks, notes, illustrative) -> str:
    lines = ["## kvarn report", ""]
    if illustrative:
        lines += ["_Illustrative fixture data, not measurements._", ""]
    if not head.empty:
        cols, fm = _headline_cols(head, tasks)
        lines += [f"_{_headline_caption(head)}_", ""]
        lines.append("| " + " | ".join(h for _, h in cols) + " |")
        lines.append("|" + "|".join("---" for _ in cols) + "|")
        for rec in head.to_dict("records"):
            lines.append("| " + " | ".join(str(fm[c](rec)) if c in fm else _fmt(rec.get(c)) for c, _ in cols) + " |")
    if notes:
        lines += ["", "**Missing or notable**", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
