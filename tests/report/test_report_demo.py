"""`kvarn report DIR --demo` writes its illustrative rows into a directory of their own and never into real results;
a report of real CPU rows says what its header cannot know in words."""
import pandas as pd

from kvarn.report import build_report
from kvarn.report.fixtures import DEMO_GPU, DEMO_MARKER, bench_row
from kvarn.results import ResultsStore
from tests.helpers import cli


def _rows(d) -> pd.DataFrame:
    return ResultsStore(d).read()


def test_demo_refuses_a_directory_with_real_results(tmp_path):
    real = tmp_path / "results"
    ResultsStore(real).append(bench_row("qwen3-8b", "auto", run_id="abc123", provenance={}))
    before = sorted(p.name for p in (real / "parts").iterdir())
    code, out, err = cli("report", str(real), "--demo", "--out", str(tmp_path / "rep"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "holds real results (1 rows)" in err and "kvarn report demo --demo" in err
    assert sorted(p.name for p in (real / "parts").iterdir()) == before and not (real / DEMO_MARKER).exists()
    assert not (tmp_path / "rep").exists()


def test_demo_refuses_a_non_empty_directory_without_results(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    code, _, err = cli("report", str(d), "--demo", "--out", str(tmp_path / "rep"))
    assert code == 2 and "is not empty" in err and (d / "notes.txt").read_text() == "mine"


def test_demo_writes_and_rewrites_only_its_own_directory(tmp_path):
    d = tmp_path / "demo"
    code, out, err = cli("report", str(d), "--demo", "--out", str(tmp_path / "rep"))
    assert code == 0, err
    first = _rows(d)
    assert (d / DEMO_MARKER).is_file() and set(first.run_id) == {"demo-run"}
    assert set(first.gpu_name.dropna()) == {DEMO_GPU}  # no fixture row claims a real GPU
    code, _, err = cli("report", str(d), "--demo", "--out", str(tmp_path / "rep"))
    assert code == 0, err
    assert len(_rows(d)) == len(first)  # replaced, not appended
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "Illustrative fixture data" in page and "NVIDIA" not in page
    # rendered later without --demo, the rows still say what they are
    rep = build_report(d, tmp_path / "again")
    assert "Illustrative fixture data" in rep.html.read_text()


def test_cpu_rows_header_says_what_is_unknown_in_words(tmp_path):
    rows = [bench_row("smollm2", kv, engine="hf", mode="offline", burst=544, prompt_len=512, output_len=32,
                      requests=2, output_tok_s=tps, kv_tokens=float("nan"), run_id="r1",
                      provenance={"gpu_count": 0, "gpu_name": None}, hf_device="cpu", kv_cache_gib=gib,
                      ppl=ppl, ppl_fp16=40.0, ppl_delta_pct=100 * (ppl / 40.0 - 1))
            for kv, tps, gib, ppl in (("auto", 2.0, 0.02, 40.0), ("fp8", 2.1, 0.01, 40.4),
                                      ("kvarn_k4v2_g128", 1.5, 0.006, 40.3))]
    ResultsStore(tmp_path / "res").append(rows)
    rep = build_report(tmp_path / "res", tmp_path / "rep")
    page = rep.html.read_text()
    assert "× 0" not in page and "GPU</b>: –" not in page
    assert "GPU</b>: none (rows measured on the CPU" in page
    assert "KV cache MiB" in page and "ppl Δ % vs fp16" in page and "CPU out tok/s" in page
    assert "chunked perplexity" in " ".join(rep.notes) and "ran on the CPU" in " ".join(rep.notes)
    assert "frontier.png" in {p.name for p in rep.pngs}
