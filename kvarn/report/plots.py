"""Static figures (matplotlib, Agg backend) for the report and for pull requests. Every function writes one PNG
and returns its path, or returns None when the data for it is absent (the caller says so in the report)."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from .data import BENCH_PPL, FP16_KV, LATENCY, format_order  # noqa: E402
from .scope import is_cross  # noqa: E402

DPI = 110
COLORS = {
    "auto": "#444444", "float16": "#444444", "bfloat16": "#444444", "fp16": "#444444",
    "fp8": "#1f77b4",
    "kvarn_k4v2_g128": "#d62728", "kvarn_k4v4_g128": "#ff7f0e", "kvarn_k4v2_g64": "#e377c2",
    "kvarn_k2v2_g128": "#8c564b",
    "turboquant_k8v4": "#2ca02c", "turboquant_4bit_nc": "#17becf", "turboquant_k3v4_nc": "#9467bd",
    "turboquant_3bit_nc": "#bcbd22",
}
_EXTRA = plt.get_cmap("tab20").colors
# no offset / scale factor on tick labels: an all-zero axis would read "1e-17" otherwise
STYLE = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9,
         "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
         "axes.formatter.useoffset": False}


def color(kv: str) -> str:
    if kv in COLORS:
        return COLORS[kv]
    return matplotlib.colors.to_hex(_EXTRA[sum(map(ord, kv)) % len(_EXTRA)])


def label(kv: str) -> str:
    return "fp16 (auto)" if kv == "auto" else kv


def panel_title(model, tp) -> str:
    return f"{model}  ·  TP={int(tp)}"


def burst_label(b) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "?"
    b = int(b)
    return f"{b // 1024}k" if b % 1024 == 0 else str(b)


def _grid(n: int, ncols_max: int = 3, w: float = 5.2, h: float = 4.2):
    ncols = min(n, ncols_max)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows + 1.1), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _legend_ncol(fig, labels: list[str]) -> int:
    """Legend columns that fit the figure's width (about 0.085 inch per character plus the marker)."""
    need = max((len(t) for t in labels), default=8) * 0.085 + 0.6
    return max(1, min(len(labels), int(fig.get_figwidth() // need)))


def _legend_formats(fig, kvs, extra=(), ncol=None) -> float:
    """A legend of every format (and `extra` handles) under the panels; returns the figure fraction it takes, for
    tight_layout's rect."""
    handles = [Line2D([], [], marker="o", ls="", color=color(k), markersize=8, label=label(k)) for k in kvs]
    handles += list(extra)
    ncol = min(ncol or 6, _legend_ncol(fig, [h.get_label() for h in handles]))
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False, bbox_to_anchor=(0.5, 0.0))
    rows = math.ceil(len(handles) / ncol)
    return min(0.45, (0.3 * rows + 0.2) / fig.get_figheight())


def _flat_axis(ax, axis: str = "y") -> None:
    """An axis whose values are all equal (e.g. every change 0) gets a visible span around them."""
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    if abs(hi - lo) < 1e-9 * max(1.0, abs(lo)):
        mid = 0.0 if abs(lo) < 1e-9 else lo
        span = max(1.0, abs(mid) * 0.1)
        (ax.set_ylim if axis == "y" else ax.set_xlim)(mid - span, mid + span)


def _declutter(fig, ax, anns, points=()) -> None:
    """Place point labels so that none overlaps another label, a marker or the axes' edge: right of the point first,
    then further up or down, then left of it (labels of close points otherwise print over each other).
    points: (x, y, marker area in points²) of the markers."""
    if not anns:
        return
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    frame = ax.get_window_extent(r)
    placed = []
    for x, y, size in points:
        px, py = ax.transData.transform((x, y))
        rad = math.sqrt(size) / 2 * fig.dpi / 72
        placed.append(Bbox([[px - rad, py - rad], [px + rad, py + rad]]))
    for a in anns:
        dx, dy = a.xyann
        h = a.get_window_extent(r).height * 72 / fig.dpi  # points
        tries = [(side, dy + k * h) for side in (1, -1) for k in (0, 1, -1, 2, -2, 3, -3)]
        for side, y_off in tries:
            a.set_ha("left" if side > 0 else "right")
            a.xyann = (side * dx, y_off)
            box = a.get_window_extent(r)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(b) for b in placed):
                break
        else:
            a.set_ha("left")
            a.xyann = (dx, dy)
        placed.append(a.get_window_extent(r))


def _save(fig, path: Path) -> Path:
    # bbox "tight": a title, legend or label that sticks out grows the canvas instead of being cut off
    fig.savefig(path, dpi=DPI, facecolor="white", bbox_inches="tight", pad_inches=0.2)
    plt.close(fig)
    return path


def mode_label(modes) -> str:
    """What the rows' bench mode is, in words (offline rows: "offline", serve rows: "serve")."""
    names = sorted({"offline" if str(m) in ("throughput", "offline", "") else str(m) for m in modes})
    return " + ".join(names)


def _source(g: pd.DataFrame, axis: str) -> str:
    """Where a frontier axis's numbers come from: the run(s) of its rows and, for throughput, the GPU (or the CPU,
    whose tokens/s say nothing about a GPU)."""
    runs = sorted({r for r in g.get(f"{axis}_run", pd.Series(dtype=str)).dropna() if r})
    text = ("run " + ", ".join(runs)) if runs else "run not recorded"
    if axis == "x":
        if g.get("hf_device", pd.Series(dtype=str)).fillna("").astype(str).str.contains("cpu").any():
            text += ", CPU (transformers): not a GPU's"
        else:
            gpus = sorted({x for x in g.get("x_gpu", pd.Series(dtype=str)).dropna() if x})
            text += (", " + ", ".join(gpus)) if gpus else ""
    return text


def frontier_png(front: pd.DataFrame, path: Path, *, task: str | None, subtitle: str = "",
                 allowed_drop_pp: float | None = None) -> Path | None:
    """Accuracy change (y, paired interval as error bars) vs throughput ratio (x); capacity ratio = marker size.
    Without an accuracy axis, capacity ratio becomes the y axis; without bench rows (no throughput), the x axis."""
    if front.empty:
        return None
    has_y = front["y"].notna().any()
    has_x = front["x"].notna().any()
    if not has_x and not has_y:
        return None
    cap_x = has_y and not has_x and front["cap"].notna().any()  # eval rows alone: accuracy against capacity
    panels = list(front.groupby(["model", "tp"], sort=False))
    with plt.rc_context(STYLE):
        fig, axes = _grid(len(panels), w=6.4, h=4.6)
        labelled, crossed = [], False
        for ax, ((model, tp), g) in zip(axes, panels):
            anns, points = [], []
            g = g[g["x"].notna()] if has_x else g
            g = g.sort_values("x") if has_x else g
            for i, rec in enumerate(g.to_dict("records")):
                x = rec["x"] if has_x else rec["cap"] if cap_x else 0.0
                y = rec["y"] if has_y else rec["cap"]
                if y is None or (isinstance(y, float) and math.isnan(y)):
                    continue
                cap = rec["cap"] if not math.isnan(rec.get("cap", math.nan)) else 1.0
                size = 40 + 55 * cap if has_y and not cap_x else 110
                if has_y and not math.isnan(rec.get("y_lo", math.nan)):
                    ax.errorbar(x, y, yerr=[[y - rec["y_lo"]], [rec["y_hi"] - y]], fmt="none",
                                ecolor=color(rec["kv_dtype"]), elinewidth=1.3, capsize=3, alpha=0.7, zorder=2)
                points.append((x, y, size))
                # a ratio against another run's FP16 cell: a square and a label that say so
                cross = is_cross(rec.get("ratio_vs")) and (has_x or not has_y)
                crossed |= cross
                ax.scatter([x], [y], s=size, color=color(rec["kv_dtype"]), alpha=0.9, zorder=3,
                           marker="s" if cross else "o", edgecolors="black" if rec["pareto"] else "white",
                           linewidths=2.2 if rec["pareto"] else 0.8)
                text = label(rec["kv_dtype"]) + (" (cross-run)" if cross else "")
                anns.append(ax.annotate(text, (x, y), textcoords="offset points",
                                        xytext=(math.sqrt(size) / 2 + 2, -4), fontsize=8, color="#222222", zorder=4))
            if has_x or cap_x:
                ax.axvline(1.0, color="#888888", lw=0.9, ls=":")
            if has_y:
                ax.axhline(0.0, color="#888888", lw=0.9, ls=":")
                if allowed_drop_pp:
                    ax.axhline(-allowed_drop_pp, color="#d62728", lw=0.9, ls="--", alpha=0.6)
                    ax.annotate(f"gate: −{allowed_drop_pp:g} pp", (0.01, -allowed_drop_pp), xycoords=("axes fraction", "data"),
                                fontsize=8, color="#d62728", va="bottom")
            metric = g["metric"].dropna().iloc[0] if g["metric"].notna().any() else None
            burst = g["burst"].dropna().iloc[0] if "burst" in g and g["burst"].notna().any() else None
            ax.set_title(panel_title(model, tp) + (f"  ·  {burst_label(burst)} burst" if burst else ""))
            scope = ("same run unless marked cross-run" if any(is_cross(v) for v in g.get("ratio_vs", ()))
                     else "same run")
            ax.set_xlabel(f"output tokens/s ÷ fp16 (same burst, {scope})\n{_source(g, 'x')}" if has_x else
                          "KV capacity ÷ fp16 (the formats' bytes for this model; no bench rows)" if cap_x else
                          "(no bench rows: throughput unavailable)")
            if has_y:
                ax.set_ylabel((f"{task} accuracy change vs fp16 (pp)" if metric == "accuracy"
                               else "chunked perplexity change vs fp16 (%, up = better)" if metric == BENCH_PPL
                               else f"{task} −Δ perplexity vs fp16 (up = better)") + f"\n{_source(g, 'y')}")
            else:
                ax.set_ylabel("KV capacity ÷ fp16")
            ax.margins(x=0.12, y=0.15)
            _flat_axis(ax, "y")
            _flat_axis(ax, "x")
            lo, hi = ax.get_xlim()
            ax.set_xlim(lo, hi + 0.3 * (hi - lo))  # room right of the rightmost points for their labels
            labelled.append((ax, anns, points))
        kvs = format_order(front["kv_dtype"])
        extra = [Line2D([], [], marker="o", ls="", markerfacecolor="white", markeredgecolor="black", markeredgewidth=2.2,
                        markersize=9, label="Pareto-optimal")]
        if has_y and not cap_x:
            extra += [Line2D([], [], marker="o", ls="", color="#999999", markersize=math.sqrt(40 + 55 * c),
                             label=f"KV capacity {c}× fp16") for c in (1, 4)]
        if crossed:
            extra.append(Line2D([], [], marker="s", ls="", color="#999999", markersize=9,
                                label="cross-run: vs another run's FP16"))
        bottom = _legend_formats(fig, kvs, extra, ncol=min(len(kvs) + len(extra), 6))
        metric = front["metric"].dropna().iloc[0] if front["metric"].notna().any() else None
        title = ("Accuracy–throughput–capacity frontier: chunked perplexity (bench rows)"
                 if has_y and metric == BENCH_PPL else f"Accuracy–capacity frontier: {task} (no bench rows)" if cap_x
                 else f"Accuracy–throughput–capacity frontier: {task}" if has_y
                 else "Throughput vs KV capacity (no eval rows: accuracy axis unavailable)")
        fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=12)
        fig.tight_layout(rect=(0, bottom, 1, 1))
        for ax, anns, points in labelled:  # once the layout is final: the labels' places depend on it
            _declutter(fig, ax, anns, points)
        return _save(fig, path)


def capacity_png(cells: pd.DataFrame, path: Path) -> Path | None:
    """KV capacity ratio vs fp16 per format, one bar group per format, one bar per model x TP."""
    if cells.empty or "kv_ratio_vs_fp16" not in cells or cells["kv_ratio_vs_fp16"].notna().sum() == 0:
        return None
    c = cells[cells["kv_ratio_vs_fp16"].notna()]
    cross = {k for k, g in c.groupby(["model", "tp", "kv_dtype"], sort=False)
             if any(is_cross(v) for v in g.get("ratio_vs", ()))}
    c = c.groupby(["model", "tp", "kv_dtype"], sort=False)["kv_ratio_vs_fp16"].median().reset_index()
    kvs = format_order(c["kv_dtype"])
    groups = list(c.groupby(["model", "tp"], sort=False).groups)
    width = 0.8 / max(len(groups), 1)
    hatches = ["", "//", "..", "xx", "\\\\", "oo"]
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(7.0, 1.35 * len(kvs) + 2), 4.6))
        for gi, (model, tp) in enumerate(groups):
            sub = c[(c["model"] == model) & (c["tp"] == tp)].set_index("kv_dtype")["kv_ratio_vs_fp16"]
            xs = np.arange(len(kvs)) + (gi - (len(groups) - 1) / 2) * width
            vals = [sub.get(k, np.nan) for k in kvs]
            bars = ax.bar(xs, vals, width * 0.95, color=[color(k) for k in kvs], hatch=hatches[gi % len(hatches)],
                          edgecolor="white", label=panel_title(model, tp))
            for b, v, k in zip(bars, vals, kvs):
                if not np.isnan(v):
                    text = f"{v:.2f}×" + ("\ncross-run" if (model, tp, k) in cross else "")
                    ax.annotate(text, (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                                fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.axhline(1.0, color="#888888", lw=0.9, ls=":")
        ax.set_ylim(0, float(np.nanmax(c["kv_ratio_vs_fp16"])) * (1.3 if cross else 1.15))  # room for the labels
        ax.set_xticks(np.arange(len(kvs)), [label(k) for k in kvs], rotation=20, ha="right")
        bytes_only = "kv_tokens" not in cells or cells["kv_tokens"].isna().all()
        ax.set_ylabel("KV capacity ÷ fp16" + (" (cache bytes)" if bytes_only else " (KV pool tokens)"))
        ax.set_title("KV capacity per format: " + ("fp16 bytes ÷ the format's real cache bytes" if bytes_only
                                                    else "measured KV pool") + " (medians over repeats)")
        if len(groups) > 1:
            handles = [plt.Rectangle((0, 0), 1, 1, facecolor="#bbbbbb", edgecolor="white", hatch=hatches[i % len(hatches)])
                       for i in range(len(groups))]
            ax.legend(handles, [panel_title(m, t) for m, t in groups], loc="upper left", frameon=False)
        fig.tight_layout()
        return _save(fig, path)


def throughput_png(cells: pd.DataFrame, path: Path) -> Path | None:
    """Output tokens/s vs burst context per format (min-max over valid repeats as error bars)."""
    if cells.empty or "output_tok_s" not in cells or cells["output_tok_s"].notna().sum() == 0:
        return None
    c = cells[cells["output_tok_s"].notna()]
    panels = list(c.groupby(["model", "tp", "mode"], sort=False))
    with plt.rc_context(STYLE):
        fig, axes = _grid(len(panels), w=6.4)
        for ax, ((model, tp, mode), g) in zip(axes, panels):
            for kv in format_order(g["kv_dtype"]):
                s = g[g["kv_dtype"] == kv].sort_values("burst")
                x = s["burst"].to_numpy(dtype=float)
                y = s["output_tok_s"].to_numpy(dtype=float)
                lo = y - s.get("output_tok_s_min", s["output_tok_s"]).to_numpy(dtype=float)
                hi = s.get("output_tok_s_max", s["output_tok_s"]).to_numpy(dtype=float) - y
                ax.errorbar(x, y, yerr=[np.nan_to_num(lo), np.nan_to_num(hi)], marker="o", ms=5, lw=1.6, capsize=3,
                            color=color(kv), label=label(kv))
            bursts = sorted(g["burst"].dropna().unique())
            if len(bursts) and all(b > 0 for b in bursts):
                ax.set_xscale("log", base=2)
                ax.set_xticks(bursts, [burst_label(b) for b in bursts])
                ax.minorticks_off()
                if len(bursts) == 1:  # one context: its points in the middle, not at the left edge
                    ax.set_xlim(bursts[0] / 2, bursts[0] * 2)
            cpu = "hf_device" in g and (g["hf_device"].astype(str).str.contains("cpu")).any()
            ax.set_title(panel_title(model, tp) + f"  ·  {mode_label([mode])}" + ("  ·  CPU" if cpu else ""))
            ax.set_xlabel("burst context (prompt + output tokens per request)")
            ax.set_ylabel("output tokens/s (median)" + (", CPU: not a GPU's" if cpu else ""))
            ax.set_ylim(bottom=0)
        bottom = _legend_formats(fig, format_order(c["kv_dtype"]))
        fig.suptitle("Throughput vs burst context\n(error bars: min–max over valid repeats)", fontsize=12)
        fig.tight_layout(rect=(0, bottom, 1, 1))
        return _save(fig, path)


def latency_png(cells: pd.DataFrame, path: Path) -> Path | None:
    """p50 bars with p90 / p99 markers for TTFT, TPOT, ITL, E2EL at each model x TP's headline burst."""
    cols = [k for k in LATENCY if f"{k}_ms_p50" in cells.columns and cells[f"{k}_ms_p50"].notna().any()]
    if cells.empty or not cols:
        return None
    from .data import headline_burst

    rows = []
    for (model, tp), g in cells.groupby(["model", "tp"], sort=False):
        b = headline_burst(cells, model, tp)
        sub = g[(g["burst"] == b) & g[f"{cols[0]}_ms_p50"].notna()] if b is not None else g
        if not sub.empty:
            rows.append(((model, tp, b), sub))
    if not rows:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.2 * len(cols), 3.6 * len(rows) + 1.0), squeeze=False)
        for r, ((model, tp, b), sub) in enumerate(rows):
            kvs = format_order(sub["kv_dtype"])
            sub = sub.set_index("kv_dtype")
            for ci, key in enumerate(cols):
                ax = axes[r][ci]
                xs = np.arange(len(kvs))
                p50 = [sub.loc[k, f"{key}_ms_p50"] for k in kvs]
                ax.bar(xs, p50, 0.6, color=[color(k) for k in kvs], alpha=0.85)
                for pct, mk in (("p90", "^"), ("p99", "x")):
                    col = f"{key}_ms_{pct}"
                    if col in sub.columns:
                        ax.scatter(xs, [sub.loc[k, col] for k in kvs], marker=mk, color="black", s=28, zorder=3)
                ax.set_xticks(xs, [label(k) for k in kvs], rotation=35, ha="right", fontsize=8)
                ax.set_title(f"{key.upper()} (ms)", fontsize=10)
                if ci == 0:  # the setting once per row of panels, not in every title
                    ax.set_ylabel(f"{model}\nTP={int(tp)} · {burst_label(b)} burst", fontsize=9)
        handles = [plt.Rectangle((0, 0), 1, 1, color="#999999", label="p50 (bar)"),
                   Line2D([], [], marker="^", ls="", color="black", label="p90"),
                   Line2D([], [], marker="x", ls="", color="black", label="p99")]
        fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False)
        modes = mode_label(pd.concat([sub.get("mode", pd.Series(dtype=str)) for _, sub in rows]).dropna())
        fig.suptitle(f"Latency percentiles ({modes} rows; medians over valid repeats)", fontsize=12)
        fig.tight_layout(rect=(0, 0.4 / fig.get_figheight(), 1, 1))
        return _save(fig, path)


def accuracy_png(ev: pd.DataFrame, path: Path) -> Path | None:
    """Change vs fp16 per task and format with the paired interval; one panel per task, one marker per model x TP."""
    if ev.empty or "delta_vs_fp16" not in ev or ev["delta_vs_fp16"].notna().sum() == 0:
        return None
    from .data import task_metric

    tasks = list(dict.fromkeys(ev["task"]))
    markers = ["o", "s", "D", "^", "v", "P"]
    with plt.rc_context(STYLE):
        fig, axes = _grid(len(tasks), ncols_max=3, w=5.4, h=0.45 * ev["kv_dtype"].nunique() + 2.4)
        models = list(dict.fromkeys(zip(ev["model"], ev["tp"])))
        for ax, task in zip(axes, tasks):
            t = ev[ev["task"] == task]
            metric = task_metric(ev, task)
            scale = 100.0 if metric == "accuracy" else 1.0
            kvs = format_order(t["kv_dtype"])
            for mi, (model, tp) in enumerate(models):
                s = t[(t["model"] == model) & (t["tp"] == tp)].set_index("kv_dtype")
                off = (mi - (len(models) - 1) / 2) * 0.22
                for yi, kv in enumerate(kvs):
                    if kv not in s.index or pd.isna(s.loc[kv, "delta_vs_fp16"]):
                        continue
                    d = s.loc[kv, "delta_vs_fp16"] * scale
                    lo = s.loc[kv].get("delta_ci_low", np.nan) * scale
                    hi = s.loc[kv].get("delta_ci_high", np.nan) * scale
                    xerr = None if np.isnan(lo) else [[d - lo], [hi - d]]
                    ax.errorbar(d, yi + off, xerr=xerr, fmt=markers[mi % len(markers)], color=color(kv), capsize=3,
                                ms=6)
            ax.axvline(0, color="#888888", lw=0.9, ls=":")
            _flat_axis(ax, "x")
            ax.set_yticks(np.arange(len(kvs)), [label(k) for k in kvs])
            ax.invert_yaxis()
            ax.set_xlabel("accuracy change vs fp16 (pp, paired interval)" if metric == "accuracy"
                          else "perplexity change vs fp16 (lower = better)")
            ax.set_title(task)
        handles = [Line2D([], [], marker=markers[i % len(markers)], ls="", color="#555555", label=panel_title(m, t))
                   for i, (m, t) in enumerate(models)]
        ncol = min(len(handles), 4, _legend_ncol(fig, [h.get_label() for h in handles]))
        fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False)
        fig.suptitle("Accuracy change vs fp16 per task", fontsize=12)
        fig.tight_layout(rect=(0, (0.3 * math.ceil(len(handles) / ncol) + 0.2) / fig.get_figheight(), 1, 1))
        return _save(fig, path)
