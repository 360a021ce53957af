"""`kvarn results`: list and filter the rows of a results directory (table, JSON lines or CSV)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from kvarn.errors import KvarnError

from ..console import out

# Default table columns per row kind (any column can be asked for with --columns).
DEFAULT_COLUMNS = {
    "bench": ("created_at", "model", "kv_dtype", "tp", "engine", "mode", "burst", "requests", "repeat", "status",
              "output_tok_s", "output_tok_s_ratio_vs_fp16", "kv_tokens", "kv_ratio_vs_fp16", "ttft_ms_p50",
              "tpot_ms_p50", "error"),
    "eval": ("created_at", "model", "kv_dtype", "tp", "engine", "task", "status", "n", "accuracy", "ppl",
             "delta_vs_fp16", "error"),
    None: ("created_at", "kind", "model", "kv_dtype", "tp", "engine", "task", "repeat", "status", "error"),
}
# What the default view leaves out first when the terminal is too narrow for every default column
NARROW_DROP = ("created_at", "repeat", "engine", "mode", "requests", "tp", "ttft_ms_p50", "tpot_ms_p50",
               "output_tok_s_ratio_vs_fp16", "kv_ratio_vs_fp16", "delta_vs_fp16", "task", "kind")


def _match(series, spec: str | None, contains: bool = False):
    wanted = [s.strip().lower() for s in (spec or "").split(",") if s.strip()]
    col = series.astype(str).str.lower()
    if contains:
        mask = col.str.contains(wanted[0], regex=False)
        for w in wanted[1:]:
            mask |= col.str.contains(w, regex=False)
        return mask
    return col.isin(wanted)


def _match_numbers(series, values: list[float]):
    import pandas as pd

    return pd.to_numeric(series, errors="coerce").isin(values)


def _fit(df, cols: list[str], width: int) -> list[str]:
    """Drop NARROW_DROP columns (in that order) until the table's natural width fits the terminal."""
    def need(cs):
        # long headers fold onto a few lines (~10 characters wide), cells do not (the error text folds at ~24)
        return sum(min(max(min(len(c), 10), max((len(_cell(v)) for v in df[c]), default=1)),
                       24 if c == "error" else 10 ** 6) + 3 for c in cs) + 1
    cols = list(cols)
    for c in NARROW_DROP:
        if need(cols) <= width:
            break
        if c in cols:
            cols.remove(c)
    return cols


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


TABLES = ("readme",)


def _print_table(table, baseline_run, df, store) -> None:
    from kvarn.errors import choices
    from kvarn.report.readme_table import readme_table

    if table not in TABLES:
        if table is None:
            raise KvarnError(f"--baseline-run goes with --table; accepted tables: {choices(TABLES)}")
        raise KvarnError(f"unknown --table {table!r}; accepted: {choices(TABLES)}")
    bench = df[df["kind"] == "bench"] if "kind" in df.columns else df.iloc[0:0]
    if baseline_run:
        runs = set(store.read("bench").get("run_id", []))
        if baseline_run not in runs:
            raise KvarnError(f"--baseline-run {baseline_run!r} is not a run of these results; accepted: "
                             f"{choices(sorted(map(str, runs))) or 'none'}")
        if "run_id" in bench.columns and baseline_run not in set(bench["run_id"]):  # filters must not drop it
            import pandas as pd

            b = store.read("bench")
            bench = pd.concat([bench, b[b["run_id"] == baseline_run]], ignore_index=True)
    print(readme_table(bench.reset_index(drop=True), baseline_run))


def register(app: typer.Typer) -> None:
    @app.command("results")
    def results(
        directory: str = typer.Argument("results", help="Results directory (holds parts/*.parquet)."),
        kind: Optional[str] = typer.Option(None, "--kind", help="bench, eval, sample or fidelity (comma list)."),
        model: Optional[str] = typer.Option(None, "--model", help="Rows whose model contains this (comma list)."),
        kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="Comma list of KV formats."),
        status: Optional[str] = typer.Option(None, "--status", help="ok, failed, timeout, oom, skipped (comma list)."),
        run_id: Optional[str] = typer.Option(None, "--run-id", help="Rows of one run (comma list)."),
        engine: Optional[str] = typer.Option(None, "--engine", help="vllm, hf (comma list)."),
        task: Optional[str] = typer.Option(None, "--task", help="Eval task (comma list, e.g. gsm8k,niah)."),
        mode: Optional[str] = typer.Option(None, "--mode", help="Bench mode: offline, serve."),
        tp: Optional[str] = typer.Option(None, "--tp", help="Tensor-parallel sizes (comma list)."),
        burst: Optional[str] = typer.Option(None, "--burst", help="Bench bursts: 16k, 4096 (comma list)."),
        columns: Optional[str] = typer.Option(None, "--columns", help="Comma list of columns to show ('all')."),
        last: Optional[int] = typer.Option(None, "--last", help="Only the newest N rows."),
        json_: bool = typer.Option(False, "--json", help="One JSON object per row (all columns)."),
        csv: bool = typer.Option(False, "--csv", help="CSV on stdout (all columns, or --columns)."),
        compact: bool = typer.Option(False, "--compact", help="Merge the stored parts into one file, then list."),
        table: Optional[str] = typer.Option(None, "--table", metavar="readme", help="Print a markdown table of the "
                                            "(filtered) bench rows instead: readme = one line per workload x "
                                            "candidate format, each ratio with the FP16 row, run and GPU it used."),
        baseline_run: Optional[str] = typer.Option(None, "--baseline-run", metavar="RUN_ID", help="With --table: "
                                                   "take the ratios against this run's FP16 rows (labelled "
                                                   "cross-run) instead of each row's own run's."),
    ) -> None:
        """List stored result rows, newest last, filtered by kind, model, KV format and status."""
        from kvarn.results import STATUSES, ResultsStore
        from kvarn.results.schema import ENGINES, KINDS

        if json_ and csv:
            raise KvarnError("give one of --json and --csv")
        root = Path(directory).expanduser()
        if not root.is_dir():
            flag = "--json" if json_ else "--csv" if csv else "--compact" if compact else "a flag"
            hint = (f" ({flag} is a flag and takes no value: {directory!r} was read as the directory)"
                    if directory.lower() in ("true", "false", "1", "0", "yes", "no") else "")
            raise KvarnError(f"results directory {directory!r} does not exist{hint}")
        store = ResultsStore(root)
        if not store.files():
            raise KvarnError(f"no results in {directory!r} (expected {root / 'parts'}/*.parquet)")
        if compact:
            before, n = store.compact()
            out.print(f"compacted {before} parts into 1 ({n} rows)" if before > 1 else "nothing to compact")
        if status:
            bad = [s for s in status.split(",") if s.strip() and s.strip() not in STATUSES]
            if bad:
                raise KvarnError(f"unknown --status {bad[0]!r}; accepted: {', '.join(STATUSES)}")
        if kind:
            bad = [k for k in kind.split(",") if k.strip() and k.strip() not in KINDS]
            if bad:
                raise KvarnError(f"unknown --kind {bad[0]!r}; accepted: {', '.join(KINDS)}")
        if last is not None and last < 1:
            raise KvarnError(f"--last must be >= 1 (the newest N rows), got {last}")
        from kvarn.bench.config import MODE_ALIASES, MODES

        if mode:
            bad = [m for m in mode.split(",") if m.strip() and m.strip().lower() not in MODE_ALIASES]
            if bad:
                raise KvarnError(f"unknown --mode {bad[0]!r}; accepted: {', '.join(MODES)}")
            mode = ",".join(MODE_ALIASES[m.strip().lower()] for m in mode.split(",") if m.strip())
        if engine:
            bad = [e for e in engine.split(",") if e.strip() and e.strip() not in ENGINES]
            if bad:
                raise KvarnError(f"unknown --engine {bad[0]!r}; accepted: {', '.join(ENGINES)}")
        from kvarn.bench.parsing import parse_int_list, parse_token_list

        numbers = {"tp": parse_int_list(tp, "--tp") if tp else None,
                   "burst": parse_token_list(burst, "--burst") if burst else None}
        df = store.read()
        for col, spec, contains in (("kind", kind, False), ("model", model, True), ("kv_dtype", kv_dtype, False),
                                    ("status", status, False), ("run_id", run_id, False), ("engine", engine, False),
                                    ("task", task, False), ("mode", mode, False)):
            if spec:
                df = df[_match(df[col], spec, contains)] if col in df.columns else df.iloc[0:0]
        for col, values in numbers.items():
            if values:
                df = df[_match_numbers(df[col], values)] if col in df.columns else df.iloc[0:0]
        if "created_at" in df.columns:
            df = df.sort_values("created_at", kind="stable")
        if last is not None:
            df = df.tail(last)
        df = df.reset_index(drop=True)
        if table is not None or baseline_run:
            _print_table(table, baseline_run, df, store)
            return
        if columns and columns.strip() != "all":
            cols = [c.strip() for c in columns.split(",") if c.strip()]
            missing = [c for c in cols if c not in df.columns]
            if missing:
                raise KvarnError(f"unknown column {missing[0]!r}; accepted: {', '.join(df.columns)}")
        elif columns or json_ or csv:
            cols = list(df.columns)
        else:
            kinds = set(df["kind"]) if "kind" in df.columns else set()
            default = DEFAULT_COLUMNS.get(next(iter(kinds)) if len(kinds) == 1 else None, DEFAULT_COLUMNS[None])
            cols = [c for c in default if c in df.columns]
        if json_:
            import json

            for rec in df[cols].to_dict("records"):
                print(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v)
                                  for k, v in rec.items()}, default=str))
            return
        if csv:
            print(df[cols].to_csv(index=False), end="")
            return
        if df.empty:
            out.print(f"no rows match in {directory} ({len(store.read())} rows stored)")
            return
        hidden = []
        if not columns:  # default view: leave out columns empty in every selected row (e.g. serve-only metrics)
            cols = [c for c in cols if df[c].notna().any() and (df[c].astype(str) != "").any()]
            if "created_at" in cols:  # minutes are enough to tell runs apart in a listing
                df = df.assign(created_at=df["created_at"].astype(str).str.slice(0, 16).str.replace("T", " "))
            kept = _fit(df, cols, out.width)
            hidden, cols = [c for c in cols if c not in kept], kept
        t = Table(title=f"{len(df)} rows in {directory}")
        for c in cols:  # identifying values stay whole; free text folds
            t.add_column(c, overflow="fold", no_wrap=c in ("model", "kv_dtype", "status", "task", "created_at"))
        for rec in df[cols].to_dict("records"):
            t.add_row(*(_cell(rec[c]) for c in cols))
        out.print(t)
        if hidden:
            out.print(f"[dim]hidden for the terminal's width: {', '.join(hidden)} (--columns all, or a wider "
                      "terminal)[/dim]")
