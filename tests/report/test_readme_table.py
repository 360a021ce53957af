"""The README's results table on one machine: suites/readme.yaml pairs every candidate with an FP16 cell of its own
`kvarn bench` run (plan, resume), and `kvarn results DIR --table readme` renders the table from stored rows, each
ratio with the FP16 row, run and GPU it came from."""

import pytest

from kvarn.report.fixtures import bench_row
from kvarn.results import ResultsStore
from tests.helpers import run_cli

CANDIDATES = ("kvarn_k4v2_g128", "fp8", "turboquant_4bit_nc", "turboquant_k3v4_nc")


def test_suite_plans_each_workload_as_one_paired_run():
    r = run_cli("suite", "run", "readme", "--dry-run", "--out", "/tmp/unused", env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    cmds = [x.split() for x in r.stdout.splitlines() if x.startswith("kvarn bench")]
    assert len(cmds) == 2  # the showcase and the 1K burst, each one `kvarn bench` run
    for argv in cmds:
        assert "--pair-fp16" in argv and argv[argv.index("--model") + 1] == "qwen3-8b" and "--dummy-weights" in argv
        assert argv[argv.index("--kv-dtype") + 1].split(",")[0] == "auto"  # FP16 first, then the candidates
    show, short = (next(a for a in cmds if a[a.index("--burst") + 1] == b) for b in ("16384", "1024"))
    assert show[show.index("--kv-dtype") + 1] == "auto,kvarn_k4v2_g128"  # rivals at 16K: the performance suite
    assert show[show.index("--requests") + 1] == "96" and show[show.index("--output-len") + 1] == "2048"
    assert short[short.index("--kv-dtype") + 1].split(",")[1:] == list(CANDIDATES)


def test_a_resumed_pair_reruns_its_fp16_cell_in_the_same_run(tmp_path, fake_bench_engine):
    """Call 1 finishes the fp8 pair; call 2 (a new run) runs the KVarN pair: its FP16 cell runs again, first, so
    KVarN pairs within run 2. A candidate stored unpaired (its FP16 row from another run) runs again."""
    fake = fake_bench_engine
    assert fake.bench(tmp_path, "--kv-dtype", "auto,fp8", "--pair-fp16") == 0
    assert fake.CALLS == [("auto", 0), ("fp8", 0)]
    assert fake.bench(tmp_path, "--kv-dtype", "auto,fp8", "--pair-fp16") == 0 and fake.CALLS == []  # done pair
    assert fake.bench(tmp_path, "--kv-dtype", "auto,kvarn_k4v2_g128", "--pair-fp16") == 0
    assert fake.CALLS == [("auto", 0), ("kvarn_k4v2_g128", 0)]
    df = ResultsStore(tmp_path / "res").read("bench")
    kv = df[df.kv_dtype == "kvarn_k4v2_g128"].iloc[0]
    fp16 = df[(df.kv_dtype == "auto") & (df.run_id == kv.run_id)].iloc[0]
    assert kv.ratio_scope == "same-run" and kv.fp16_row_id == fp16.row_id and kv.kv_ratio_vs_fp16 == pytest.approx(4.7)
    assert df[df.kv_dtype == "auto"].run_id.nunique() == 2
    # a plain resume leaves a candidate unpaired; --pair-fp16 reruns it with a fresh FP16 cell
    assert fake.bench(tmp_path, "--kv-dtype", "auto,turboquant_4bit_nc") == 0
    assert fake.CALLS == [("turboquant_4bit_nc", 0)]
    assert fake.bench(tmp_path, "--kv-dtype", "auto,turboquant_4bit_nc", "--pair-fp16") == 0
    assert fake.CALLS == [("auto", 0), ("turboquant_4bit_nc", 0)]


def _rows():
    """Three runs on one GPU: fp8 with its FP16 (run a), KVarN with its FP16 (run b), TurboQuant resumed in run c
    without an FP16 cell (unpaired), and a cut TurboQuant cell."""
    from kvarn.bench.ratios import with_ratios
    import pandas as pd

    prov = {"gpu_name": "NVIDIA H200"}
    cfg = dict(burst=16384, prompt_len=14336, output_len=2048, requests=96)
    rows = [bench_row("Qwen/Qwen3-8B", "auto", output_tok_s=1100.0, kv_tokens=800_000, run_id="a", row_id="fa",
                      **cfg, **prov),
            bench_row("Qwen/Qwen3-8B", "fp8", output_tok_s=1650.0, kv_tokens=1_600_000, run_id="a", row_id="ca",
                      **cfg, **prov),
            bench_row("Qwen/Qwen3-8B", "auto", output_tok_s=1000.0, kv_tokens=800_000, run_id="b", row_id="fb",
                      **cfg, **prov),
            bench_row("Qwen/Qwen3-8B", "kvarn_k4v2_g128", output_tok_s=2000.0, kv_tokens=3_600_000, run_id="b",
                      row_id="cb", **cfg, **prov),
            bench_row("Qwen/Qwen3-8B", "turboquant_4bit_nc", output_tok_s=300.0, kv_tokens=3_000_000, run_id="c",
                      row_id="cc", **cfg, **prov),
            bench_row("Qwen/Qwen3-8B", "turboquant_k3v4_nc", status="timeout", run_id="b", row_id="cd",
                      error="no result after 1800 s; reached: 600 s into the burst", **cfg, **prov)]
    return with_ratios(pd.DataFrame(rows)).to_dict("records")


def test_table_from_stored_rows_names_each_ratios_fp16_row(tmp_path):
    ResultsStore(tmp_path).append(_rows())
    r = run_cli("results", str(tmp_path), "--table", "readme")
    assert r.returncode == 0, r.stderr
    lines = {ln.split("|")[2].strip(): ln for ln in r.stdout.splitlines() if ln.startswith("| Qwen3-8B")}
    assert set(lines) == {"fp8", "kvarn_k4v2_g128", "turboquant_4bit_nc", "turboquant_k3v4_nc"}
    assert "96 x (14,336 + 2,048)" in lines["fp8"]
    assert "1.50x" in lines["fp8"] and "2.00x" in lines["fp8"] and "fa · a · NVIDIA H200" in lines["fp8"]
    assert "2.00x" in lines["kvarn_k4v2_g128"] and "4.50x" in lines["kvarn_k4v2_g128"]
    assert "1,000.0, 800,000" in lines["kvarn_k4v2_g128"] and "fb · b · NVIDIA H200" in lines["kvarn_k4v2_g128"]
    # never paired with run a's or b's FP16 row
    assert "unpaired" in lines["turboquant_4bit_nc"] and "no FP16 row of run c" in lines["turboquant_4bit_nc"]
    assert "timeout: no result after 1800 s" in lines["turboquant_k3v4_nc"]
    assert "same run on the same GPU" in r.stdout and "cross-run" not in r.stdout
    # a cross-run comparison only when asked for, and labelled
    r = run_cli("results", str(tmp_path), "--table", "readme", "--baseline-run", "b")
    tq = next(ln for ln in r.stdout.splitlines() if "| turboquant_4bit_nc |" in ln)
    assert "0.30x" in tq and "fb · b · NVIDIA H200 (cross-run: the candidate is from run c)" in tq
    r = run_cli("results", str(tmp_path), "--table", "html")
    assert r.returncode == 2 and "unknown --table 'html'; accepted: readme" in r.stderr
    r = run_cli("results", str(tmp_path), "--table", "readme", "--baseline-run", "zzz")
    assert r.returncode == 2 and "--baseline-run 'zzz' is not a run" in r.stderr


def test_report_cells_label_where_ratios_come_from(tmp_path):
    from kvarn.report.data import bench_cells, normalise_bench
    import pandas as pd

    cells = bench_cells(normalise_bench(pd.DataFrame(_rows()))).set_index("kv_dtype")
    assert cells.loc["kvarn_k4v2_g128", "ratio_vs"] == "same-run"
    assert cells.loc["turboquant_4bit_nc", "ratio_vs"] == "unpaired"
    assert pd.isna(cells.loc["turboquant_4bit_nc", "kv_ratio_vs_fp16"])  # no fallback to another run's FP16 cell


def test_report_html_says_where_each_ratio_comes_from(tmp_path):
    from kvarn.report import build_report

    rows = _rows()
    rows[-2].update(ratio_scope="cross-run", fp16_run_id="b", fp16_row_id="fb", kv_ratio_vs_fp16=3.75)
    ResultsStore(tmp_path / "res").append(rows)
    rep = build_report(tmp_path / "res", tmp_path / "rep")
    html = rep.html.read_text()
    assert "ratios vs" in html and "cross-run (FP16 of run b)" in html and "same-run" in html
