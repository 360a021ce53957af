"""What `kvarn bench` shows: the plan table (--dry-run), a Rich live view while cells run, the summary table."""
from __future__ import annotations

import math
import statistics
import time

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..formats import FP16_NAMES
from ..tablefit import drop_to_fit
from .config import Cell
from .plan import BenchPlan
from .ratios import CROSS_RUN, SAME_RUN, UNPAIRED, as_float, fp16_reference, ratios


def _f(x, fmt: str = "{:,.1f}", none: str = "-") -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return none
    return none if math.isnan(v) else fmt.format(v)


def plan_table(plan: BenchPlan) -> Table:
    c0 = plan.configs[0]
    t = Table(title=f"kvarn bench plan: {len(plan.cells)} cells ({len(plan.configs)} configurations x "
                    f"{plan.repeats} repeats), {len(plan.todo)} to run, {plan.done} done",
              caption=f"{c0.model} | engine {c0.engine} | mode {c0.mode} | "
                      f"{'dummy' if c0.dummy_weights else 'real'} weights | results -> {plan.out}")
    # fits an 80-column terminal with the longest dtype name (no column shrinks to nothing); hash = the first 8 hex
    # of config_hash (logs/<config_hash>-r<k>.log)
    t.box, t.pad_edge, t.collapse_padding = box.SIMPLE_HEAD, False, True
    for col in ("#", "kv dtype", "TP", "burst", "reqs x (in+out)", "dtype", "to run", "hash"):
        t.add_column(col, justify="right" if col in ("#", "TP", "burst") else "left", no_wrap=True)
    todo = {(c.hash, c.repeat) for c in plan.todo}
    for i, c in enumerate(plan.configs, 1):
        left = sum(1 for k in range(plan.repeats) if (c.hash, k) in todo)
        t.add_row(str(i), c.kv_dtype, str(c.tp), f"{c.burst:,}", f"{c.requests}x({c.prompt_len}+{c.output_len})",
                  c.model_dtype or "model's", f"{left}/{plan.repeats}" if left else "done", c.hash[:8])
    return t


def timing(row: dict) -> str:
    """The seconds a finished cell's line shows: the timed burst its tok/s are computed over, then the cell's wall
    time (engine start, warm-up and the perplexity pass included), each named."""
    parts = [f"burst {_f(row.get('duration_s'), '{:.1f}')} s"] if _f(row.get("duration_s")) != "-" else []
    return ", ".join(parts + [f"wall {_f(row.get('wall_s'), '{:.1f}')} s"])


class LiveView:
    """Progress bar (current configuration, done/total, elapsed, ETA) with one line per finished cell."""

    def __init__(self, console: Console, plan: BenchPlan):
        self.console, self.plan = console, plan
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, transient=False, refresh_per_second=2)
        self.task = None
        self.t0 = time.monotonic()

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task("starting", total=len(self.plan.todo))
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def cell_started(self, cell: Cell, index: int) -> None:
        c = cell.config
        self.progress.update(self.task, description=f"{c.kv_dtype} TP={c.tp} {c.requests}x({c.prompt_len}+"
                                                    f"{c.output_len}) r{cell.repeat}")

    def cell_finished(self, cell: Cell, row: dict) -> None:
        c = cell.config
        mark = {"ok": "[green]ok[/]", "skipped": "[yellow]skipped[/]"}.get(row["status"], f"[red]{row['status']}[/]")
        kv = (f"KV {_f(row.get('kv_tokens'), '{:,.0f}')} tokens" if _f(row.get("kv_tokens")) != "-"
              else f"KV cache {_f(float(row.get('kv_cache_gib') or 'nan') * 1024)} MiB")
        extra = (f"{_f(row.get('output_tok_s'))} out tok/s, {kv}" if row["status"] == "ok"
                 else row.get("error", "")[:160])
        self.progress.console.print(f"{mark} {c.kv_dtype} TP={c.tp} burst {c.burst} r{cell.repeat} "
                                    f"({timing(row)}): {extra}", markup=True, highlight=False)
        self.progress.advance(self.task)


def _median(vals):
    vals = [float(v) for v in vals if v is not None and not math.isnan(float(v))]
    return statistics.median(vals) if vals else float("nan")


STALL_S = 3.0  # an inter-token gap this long (and 20x the median) is no step of a normal schedule
JIT_NOTE_S = 0.5  # kernel compiles inside a timed burst worth a note (a disk-cache load takes ~0.01-0.4 s)


def stall_notes(rows: list[dict]) -> list[str]:
    """One line per ok row whose throughput a stall that every running request shared understates: kernels that
    compiled during the timed burst (`jit_compiles`, from the cell's log), else a longest inter-token gap (itl_ms_max)
    of seconds against a median of milliseconds. The gap test leaves out rows with preemptions: a preempted request's
    gap spans its wait for re-admission and its recompute (130 s in a Qwen3-32B showcase run), which
    says nothing about the other requests (the trade-off: no false alarm on every preempting run)."""
    notes = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        rep = as_float(r.get("repeat"))
        who = lambda: f"note: {r.get('kv_dtype')} (repeat {'?' if math.isnan(rep) else int(rep)}):"  # noqa: E731
        n_jit, jit_s = as_float(r.get("jit_compiles")), as_float(r.get("jit_compile_s"))
        if n_jit > 0 and not jit_s < JIT_NOTE_S:  # disk-cache loads of ~0.01 s are no stall (NaN: unknown, noted)
            notes.append(f"{who()} {int(n_jit)} kernel compile(s) during the timed burst, "
                         + ("?" if math.isnan(jit_s) else f"{jit_s:.1f}") + f" s ({r.get('jit_kernels') or '?'}): "
                         "every running request waited; its throughput is understated")
            continue
        mx, p50, pre = as_float(r.get("itl_ms_max")), as_float(r.get("itl_ms_p50")), as_float(r.get("preemptions"))
        if math.isnan(mx) or math.isnan(p50) or pre > 0:
            continue
        if mx >= STALL_S * 1000 and mx >= 20 * p50:
            if r.get("engine") == "hf":  # PyTorch on its own compiles no kernels
                cause = "the hf engine compiles nothing: a busy or shared machine?"
            elif n_jit == 0:
                cause = "its log shows no kernel compile in the burst"
            else:
                cause = "a kernel compiling mid-run? the cell's log has a line per Triton compile"
            notes.append(f"{who()} one inter-token gap took {mx / 1000:.1f} s against an ITL p50 of {p50:.1f} ms, "
                         f"a stall all running requests shared ({cause}): its throughput is understated")
    return notes


START_NOTE_S = 5.0  # compile seconds in an engine start worth a line: a cold compile cache


def start_notes(rows: list[dict]) -> list[str]:
    """One line per ok row whose engine start spent START_NOTE_S or more compiling (kvarn.bench.jit_log.start_costs):
    what the start paid for, so a slow start reads as a cold cache (a rerun on the machine starts faster), not as
    the format's cost per start."""
    notes = []
    for r in rows:
        start, jit = as_float(r.get("engine_start_s")), as_float(r.get("start_jit_compile_s"))
        n = as_float(r.get("start_jit_compiles"))
        # NaN seconds: a compile line without its duration (counted, unknown time): noted when any compiled
        if r.get("status") != "ok" or math.isnan(start) or jit < START_NOTE_S or (math.isnan(jit) and not n > 0):
            continue
        parts = [f"{int(n)} Triton compiles " + ("? s" if math.isnan(jit) else f"{jit:.1f} s")]
        for key, label in (("start_torch_compile_s", "torch.compile"), ("start_graph_capture_s", "graph capture"),
                           ("start_kvarn_warmup_s", "kvarn kernel warm-up (its compiles included)")):
            v = as_float(r.get(key))
            if not math.isnan(v):
                parts.append(f"{label} {v:.1f} s")
        notes.append(f"note: {r.get('kv_dtype')} engine start {start:.1f} s: " + ", ".join(parts)
                     + " (a cold compile cache: a rerun on this machine starts faster)")
    return notes


def cpu_label(rows: list[dict]) -> str:
    """The line that says throughput was measured on a CPU, when any row was (empty otherwise)."""
    if not any(str(r.get("hf_device") or "") == "cpu" for r in rows):
        return ""
    return "tok/s measured on the CPU (transformers): not representative of a GPU; KV from the caches' real bytes"


def _scope(m: dict) -> str:
    """Where a candidate's ratios come from, shown only when that is not this run's FP16 row."""
    if m["kv_dtype"] in FP16_NAMES or m.get("status") != "ok":
        return ""
    return m.get("ratio_scope") if m.get("ratio_scope") in (CROSS_RUN, UNPAIRED) else ""


def scope_caption(med: list[dict]) -> str:
    """What the "fp16 from" labels mean, with the baseline runs the cross-run ratios name."""
    cross = sorted({str(m.get("fp16_run_id") or "?") for m in med if _scope(m) == CROSS_RUN})
    lines = [f"cross-run: ratios against the FP16 row(s) of run {', '.join(cross)}, not of the candidate's own run"
             ] if cross else []
    if any(_scope(m) == UNPAIRED for m in med):
        lines.append("unpaired: no FP16 row of the candidate's own run, so no ratio (--pair-fp16 measures one)")
    return "\n".join(lines)


def summary_table(rows: list[dict], title: str = "kvarn bench summary (medians over ok repeats)",
                  width: int | None = None, baseline_run: str | None = None) -> Table:
    """One line per configuration: status counts, medians, ratios vs the FP16 row of the same group."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["config_hash"], []).append(r)
    med = []
    for h, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        base = dict(rs[-1])
        for k in ("output_tok_s", "total_tok_s", "kv_tokens", "kv_cache_gib", "max_concurrency", "peak_running",
                  "preemptions", "ttft_ms_p50", "tpot_ms_p50", "engine_start_s", "gpu_mem_gib", "ppl",
                  "ppl_delta_pct", "kv_ratio_vs_fp16", "output_tok_s_ratio_vs_fp16"):
            base[k] = _median([r.get(k) for r in ok])
        if not ok:  # a timed-out cell still knows its capacity and start (its progress): shown, not compared
            for k in ("kv_tokens", "max_concurrency", "engine_start_s"):
                base[k] = _median([r.get(k) for r in rs])
        # the label names what the median ratios were taken over: repeats of other runs (a resume) that found no
        # FP16 row of their run add no ratio, so the cell is unpaired only when none of its ok repeats is paired
        scopes = [r.get("ratio_scope") for r in ok]
        cross = [r for r in ok if r.get("ratio_scope") == CROSS_RUN]
        if cross:
            base.update(ratio_scope=CROSS_RUN, fp16_run_id=cross[-1].get("fp16_run_id"))
        elif ok and SAME_RUN not in scopes and UNPAIRED in scopes:
            base["ratio_scope"] = UNPAIRED
        elif SAME_RUN in scopes:
            base["ratio_scope"] = SAME_RUN
        base["status"] = "ok" if ok else rs[-1]["status"]
        base["n_ok"], base["n"] = len(ok), len(rs)
        base["repeat"] = -1
        med.append(base)
    for m in med:
        ref = m if m["kv_dtype"] in FP16_NAMES else fp16_reference(m, med, baseline_run)
        if ref is not None or m["status"] != "ok":
            m.update(ratios(m, ref))
        # else: its FP16 cell is not in this table: the stored ratios stand, with the baseline they name
    rows_out = []
    for m in med:
        kv = _f(m.get("kv_tokens"), "{:,.0f}")
        if kv == "-" and _f(m.get("kv_cache_gib")) != "-":
            kv = f"{float(m['kv_cache_gib']) * 1024:,.1f} MiB"
        rows_out.append({
            "model": str(m["model"]).split("/")[-1], "TP": str(m["tp"]), "burst": f"{m['burst']:,}",
            "kv dtype": m["kv_dtype"], "ok/runs": f"{m['n_ok']}/{m['n']}", "out tok/s": _f(m["output_tok_s"]),
            "total tok/s": _f(m["total_tok_s"]), "x fp16 tok/s": _f(m["output_tok_s_ratio_vs_fp16"], "{:.2f}x"),
            "KV tokens": kv, "x fp16 KV": _f(m["kv_ratio_vs_fp16"], "{:.2f}x"),
            "ppl": _f(m["ppl"], "{:.3f}"), "Δ ppl": _f(m["ppl_delta_pct"], "{:+.2f}%"),
            "fp16 from": _scope(m),
            "max reqs@burst": _f(m["max_concurrency"]), "peak running": _f(m["peak_running"], "{:.0f}"),
            "preempt": _f(m["preemptions"], "{:.0f}"), "TTFT p50 ms": _f(m["ttft_ms_p50"]),
            "TPOT p50 ms": _f(m["tpot_ms_p50"], "{:.2f}"), "start s": _f(m["engine_start_s"]),
            "error": "" if m["status"] == "ok" else f"{m['status']}: {m.get('error', '')}"[:240]})  # "reached: ..." too
    # what is the same on every row goes in the title, what is empty everywhere is left out: the table stays
    # readable in an 80-column terminal
    fixed = [c for c in ("model", "TP", "burst") if len({r[c] for r in rows_out}) == 1]
    title += "".join(f" | {c} {rows_out[0][c]}" for c in fixed) if rows_out else ""
    where = cpu_label(rows)
    if where:
        title += f"\n{where}"
    cols = [c for c in (rows_out[0] if rows_out else {}) if c not in fixed
            and any(r[c] not in ("-", "") for r in rows_out)]
    if all(r["ok/runs"] == "1/1" for r in rows_out) and "ok/runs" in cols:
        cols.remove("ok/runs")
    # a narrow terminal drops the least-read columns first rather than folding every cell; the absolute KV column
    # goes last, so that its ratio and the "fp16 from" label (never dropped) keep their room
    cols = drop_to_fit(rows_out, cols, ("start s", "preempt", "peak running", "max reqs@burst", "TTFT p50 ms",
                                        "total tok/s", "ok/runs", "TPOT p50 ms", "ppl", "KV tokens"), width)
    t = Table(title=title, caption=scope_caption(med) or None)
    for c in cols:
        header = "KV cache" if c == "KV tokens" and all(r[c].endswith("MiB") for r in rows_out) else c  # hf: bytes
        if where and c == "out tok/s":
            header = "CPU tok/s"
        t.add_column(header, justify="left" if c in ("model", "kv dtype", "error") else "right",
                     no_wrap=c not in ("error", "model"), overflow="fold")
    for r in rows_out:
        t.add_row(*(r[c] for c in cols))
    return t
