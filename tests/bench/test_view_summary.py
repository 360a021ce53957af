"""What `kvarn bench` prints: the summary table keeps the label of a ratio that is not this run's in an
80-column terminal, and a finished cell's line names the seconds its rate was computed over."""
import io
from types import SimpleNamespace

import pandas as pd
from rich.console import Console

from kvarn.bench.ratios import with_ratios
from kvarn.bench.view import LiveView, summary_table
from kvarn.report.fixtures import bench_row

CFG = dict(engine="hf", mode="offline", burst=544, prompt_len=512, output_len=32, requests=2)


def cpu_row(kv, tok_s, run, **extra):
    return bench_row("HuggingFaceTB/SmolLM2-135M-Instruct", kv, output_tok_s=tok_s, kv_tokens=float("nan"),
                     run_id=run, row_id=f"{run}-{kv}", provenance={}, hf_device="cpu", gpu_name="",
                     kv_cache_gib=0.01, ppl=46.9, ppl_delta_pct=-0.77, total_tok_s=200.0, peak_running=2,
                     preemptions=0, ttft_ms_p50=2648.4, tpot_ms_p50=75.0, engine_start_s=16.3, **CFG, **extra)


def render(rows, width=80, baseline_run=None) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width).print(summary_table(rows, width=width, baseline_run=baseline_run))
    return buf.getvalue()


def test_a_cross_run_label_survives_an_80_column_terminal():
    fp16 = cpu_row("auto", 15.0, "run1ab23cd45")
    cand = cpu_row("kvarn_k4v2_g128", 12.0, "run2ef67ab89")
    rows = with_ratios(pd.DataFrame([fp16, cand]), baseline_run="run1ab23cd45").to_dict("records")
    for shown in ([rows[1]], rows):  # the candidate alone (what a --baseline-run call prints), and with its FP16
        out = render(shown, baseline_run="run1ab23cd45")
        line = next(ln for ln in out.splitlines() if "kvarn_k4v2_g128" in ln)
        assert "0.80x" in line and "cross-run" in line and "Δ ppl" in out
        assert "run1ab23cd45" in out.replace("\n", " ")  # the baseline run, named under the table
        assert max(len(ln) for ln in out.splitlines()) <= 80


def test_an_unpaired_candidate_says_so_at_80_columns():
    cand = with_ratios(pd.DataFrame([cpu_row("kvarn_k4v2_g128", 12.0, "run3")])).to_dict("records")
    line = next(ln for ln in render(cand).splitlines() if "kvarn_k4v2_g128" in ln)
    assert "unpaired" in line


def test_repeats_of_two_runs_show_the_ratio_they_have():
    """Repeat 0 paired in run a, repeat 1 (a resume, run b) without an FP16 row: the ratio shown is run a's, and
    the label is not 'unpaired'."""
    rows = [cpu_row("auto", 15.0, "a"), cpu_row("kvarn_k4v2_g128", 12.0, "a"),
            cpu_row("kvarn_k4v2_g128", 9.0, "b", repeat=1)]
    rows = with_ratios(pd.DataFrame(rows)).to_dict("records")
    line = next(ln for ln in render(rows[1:], width=200).splitlines() if "kvarn_k4v2_g128" in ln)
    assert "0.80x" in line and "unpaired" not in line


def test_a_finished_cell_names_its_burst_and_wall_seconds():
    buf = io.StringIO()
    console = Console(file=buf, width=160)
    cell = SimpleNamespace(config=SimpleNamespace(kv_dtype="auto", tp=1, burst=544, requests=2, prompt_len=512,
                                                  output_len=32), repeat=0)
    row = {"status": "ok", "output_tok_s": 15.2, "kv_cache_gib": 0.0233, "duration_s": 4.21, "wall_s": 23.04}
    with LiveView(console, SimpleNamespace(todo=[cell])) as view:
        view.cell_finished(cell, row)
    line = next(ln for ln in buf.getvalue().splitlines() if ln.startswith("ok auto"))
    assert "(burst 4.2 s, wall 23.0 s): 15.2 out tok/s" in line
