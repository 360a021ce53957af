"""Every ratio the report shows says what it was measured against: the FP16 cell of its own run, another run's
(cross-run, asked for with --baseline-run), or none (unpaired); and a cell holds one run's rows, so its figures and
its ratio agree. The rows are the CPU (hf engine) shape `kvarn bench` writes on a machine without a GPU."""
import re

import matplotlib.figure
import matplotlib.text
import pandas as pd
import pytest

from kvarn.bench.ratios import with_ratios
from kvarn.report import build_report
from kvarn.report.fixtures import bench_row
from kvarn.results import ResultsStore
from tests.helpers import run_cli

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CFG = dict(engine="hf", mode="offline", burst=544, prompt_len=512, output_len=32, requests=2)


def cpu_row(kv, tok_s, mib, run, at, row_id):
    return bench_row(MODEL, kv, output_tok_s=tok_s, kv_tokens=float("nan"), run_id=run, row_id=row_id,
                     created_at=at, provenance={}, hf_device="cpu", gpu_name="", kv_cache_gib=mib / 1024, ppl=46.9,
                     ppl_delta_pct=0.0 if kv == "auto" else -0.77, **CFG)


def _text(html: str) -> str:
    html = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&#x27;", "'")


def _line(md: str, kv: str) -> str:
    return next(ln for ln in md.splitlines() if ln.startswith("|") and f"| {kv} |" in ln)


@pytest.fixture
def cross_run(tmp_path):
    """Run A measured FP16; run B measured KVarN with --baseline-run A (its ratios: cross-run)."""
    rows = [cpu_row("auto", 15.0, 24.0, "runA", "2026-01-01T10:00:00", "fa"),
            cpu_row("kvarn_k4v2_g128", 12.0, 10.0, "runB", "2026-01-01T11:00:00", "kb")]
    ResultsStore(tmp_path / "res").append(with_ratios(pd.DataFrame(rows), baseline_run="runA").to_dict("records"))
    return tmp_path / "res"


def test_cross_run_ratios_are_labelled_in_the_headline_and_summary(cross_run, tmp_path):
    rep = build_report(cross_run, tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    kv = _line(md, "kvarn_k4v2_g128")
    assert "0.80× (cross-run)" in kv and "2.40× (cross-run)" in kv and "cross-run (FP16 of run runA)" in kv
    assert "same-run" in _line(md, "fp16 (auto)")
    # the caption under which the ratios stand says that some are another run's
    assert "cross-run is against the FP16 cell of another run" in md
    page = _text(rep.html.read_text())
    head = page[page.index("Headline Per model"):page.index("Figures Frontier")]
    assert "0.80× (cross-run)" in head and "cross-run (FP16 of run runA)" in head
    assert "cross-run is against the FP16 cell of another run" in head
    assert "labelled (cross-run) are ratios against another run's FP16 cell" in page  # the frontier's caption


def test_the_frontier_marks_a_cross_run_point(cross_run, tmp_path, monkeypatch):
    texts = []
    save = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):
        texts.extend(t.get_text() for t in fig.findobj(matplotlib.text.Text))
        return save(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    build_report(cross_run, tmp_path / "rep")
    assert "kvarn_k4v2_g128 (cross-run)" in texts  # the point's label
    assert any("cross-run" in t and "another run" in t for t in texts)  # the legend
    assert "2.40×\ncross-run" in texts  # the capacity bar


def test_a_same_run_report_says_same_run_only(tmp_path):
    rows = [cpu_row("auto", 15.0, 24.0, "runA", "2026-01-01T10:00:00", "fa"),
            cpu_row("kvarn_k4v2_g128", 12.0, 10.0, "runA", "2026-01-01T10:01:00", "ka")]
    ResultsStore(tmp_path / "res").append(with_ratios(pd.DataFrame(rows)).to_dict("records"))
    build_report(tmp_path / "res", tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "0.80× |" in _line(md, "kvarn_k4v2_g128") and "cross-run" not in md and "unpaired" not in md


def test_a_forced_rerun_without_fp16_replaces_the_cell_and_is_unpaired(tmp_path):
    """`cp -r res res_x; kvarn bench --out res_x --kv-dtype kvarn_k4v2_g128 --force`: run B's KVarN row has no FP16
    row of its run. Its cell shows run B's figures and no ratio; run A's paired row is listed as superseded."""
    rows = [cpu_row("auto", 15.0, 24.0, "runA", "2026-01-01T10:00:00", "fa"),
            cpu_row("kvarn_k4v2_g128", 12.0, 10.0, "runA", "2026-01-01T10:01:00", "ka"),
            cpu_row("kvarn_k4v2_g128", 9.0, 10.0, "runB", "2026-01-02T09:00:00", "kb")]
    ResultsStore(tmp_path / "res").append(with_ratios(pd.DataFrame(rows)).to_dict("records"))
    rep = build_report(tmp_path / "res", tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    kv = [c.strip() for c in _line(md, "kvarn_k4v2_g128").split("|")]
    head = [c.strip() for c in md.splitlines()[md.splitlines().index(next(
        ln for ln in md.splitlines() if ln.startswith("| model")))].split("|")]
    cell = dict(zip(head, kv))
    assert cell["CPU out tok/s"] == "9.00"  # run B's own figure, not the median of both runs (10.5)
    assert cell["tok/s ÷ fp16"] == "unpaired" and cell["KV ÷ fp16"] == "unpaired" and cell["ratios vs"] == "unpaired"
    assert "Pareto" in cell and cell["Pareto"] == ""
    assert "unpaired row has no FP16 cell in its own run" in md
    page = _text(rep.html.read_text())
    cells = page[page.index("Bench cells (medians"):page.index("Eval summaries")]
    assert "runA, runB" not in cells and "10.50" not in cells
    old = page[page.index("Superseded runs (listed"):page.index("Provenance run_id")]
    assert "kvarn_k4v2_g128 runA" in old and "0.80×" in old and "same-run" in old and old.rstrip().endswith("runB")
    assert "Superseded runs" in " ".join(rep.notes)
    r = run_cli("report", str(tmp_path / "res"), "--out", str(tmp_path / "cli"))
    assert r.returncode == 0, r.stderr
