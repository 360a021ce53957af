"""kvarn report from fixture results: files, content, bench-only / eval-only / both, failed rows listed not plotted."""
import json
import re

import pytest

from kvarn.errors import KvarnError
from kvarn.report import build_report
from kvarn.report.data import bench_cells, normalise_bench, pareto_mask
from kvarn.report.fixtures import DEMO_FORMATS, bench_row, write_demo_results
from kvarn.results import ResultsStore
from tests.helpers import run_cli

PNG = b"\x89PNG\r\n\x1a\n"
MODELS = (("qwen3-8b", 1), ("qwen3-32b", 2))


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = tmp_path_factory.mktemp("both")
    write_demo_results(root, models=MODELS, bursts=(4096, 16384), repeats=3)
    return root


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", " ", re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html))


def test_full_report(both, tmp_path):
    rep = build_report(both, tmp_path / "r", allowed_drop_pp=2)
    names = {p.name for p in rep.pngs}
    assert {"frontier.png", "capacity.png", "throughput_vs_burst.png", "latency.png", "accuracy.png"} <= names
    for p in rep.pngs:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000
    page = rep.html.read_text()
    assert page.count("data:image/png;base64,") == len(rep.pngs)  # self-contained
    assert "http://" not in page and "https://" not in page  # no CDN, opens offline
    text = _text(page)
    for kv in DEMO_FORMATS:
        assert (kv if kv != "auto" else "fp16 (auto)") in text
    for m, _ in MODELS:
        assert m in text
    for prov in ("illustrative (no real GPU) × 2", "0123abcd4567", "0.26.0", "570.124.06"):  # GPU, git, vLLM, driver
        assert prov in text
    # the one OOM run is listed under Failed runs, and kept out of medians
    assert "CUDA out of memory" in text and "1 bench run(s) failed" in text
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "| qwen3-8b | 1 | kvarn_k4v2_g128 | 16k |" in summary and "4.42×" in summary
    meta = json.loads((tmp_path / "r" / "report.json").read_text())
    assert meta["counts"]["invalid_bench_runs"] == 1 and set(meta["models"]) == {m for m, _ in MODELS}


def test_failed_runs_not_in_medians(tmp_path):
    s = ResultsStore(tmp_path / "res")
    s.append([bench_row("qwen3-8b", "auto", repeat=r, output_tok_s=1000.0) for r in range(3)]
             + [bench_row("qwen3-8b", "fp8", repeat=0, output_tok_s=1200.0),
                bench_row("qwen3-8b", "fp8", repeat=1, output_tok_s=9999.0, completed=10),  # incomplete: not counted
                bench_row("qwen3-8b", "fp8", repeat=2, status="failed", error="engine died")])
    cells = bench_cells(normalise_bench(s.read("bench")))
    fp8 = cells[cells.kv_dtype == "fp8"].iloc[0]
    assert fp8.valid_runs == 1 and fp8.invalid_runs == 2 and fp8.output_tok_s == 1200.0
    assert fp8.output_tok_s_ratio_vs_fp16 == pytest.approx(1.2)  # computed vs the fp16 cell when bench did not


def test_bench_only_says_accuracy_is_missing(tmp_path):
    write_demo_results(tmp_path / "b", models=MODELS[:1], bursts=(16384,), repeats=1, evals=False, mode="throughput")
    rep = build_report(tmp_path / "b", tmp_path / "r")
    text = _text(rep.html.read_text())
    assert "No eval rows: accuracy axis unavailable" in text
    assert "one burst context only" in text and "No latency percentiles" in text
    names = {p.name for p in rep.pngs}
    assert "frontier.png" in names and "accuracy.png" not in names and "latency.png" not in names
    # a task asked for by name must be in the results: a bench-only run has none, said in one line, exit 2
    r = run_cli("report", str(tmp_path / "b"), "--out", str(tmp_path / "cli"), "--task", "gsm8k")
    assert r.returncode == 2 and "--task 'gsm8k'" in r.stderr and "has no eval rows" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_eval_only_says_throughput_is_missing(tmp_path):
    write_demo_results(tmp_path / "e", models=MODELS, bench=False)
    rep = build_report(tmp_path / "e", tmp_path / "r")
    text = _text(rep.html.read_text())
    assert "No bench rows: throughput and latency are unavailable" in text
    assert "bytes give each model" in text and "not a measured pool" in text
    names = {p.name for p in rep.pngs}
    assert "accuracy.png" in names and "capacity.png" not in names and "frontier.png" in names
    assert "kvarn_k4v2_g128" in text and "qwen3-32b" in text
    assert "bytes give the model (no bench rows)" in text


def test_eval_only_frontier_takes_capacity_from_the_format_bytes():
    """Without bench rows the frontier's capacity is the page-byte ratio for the model's shape: 512 / 108 per token
    and head at D=128 for the KVarN default on every layer, TurboQuant's 16-bit first and last two layers counted."""
    import math

    import pandas as pd

    from kvarn.report.data import frontier

    ev = pd.DataFrame([{"model": "Qwen/Qwen3-8B", "tp": 1, "task": "gsm8k", "kv_dtype": kv, "metric": "accuracy",
                        "accuracy": 0.5, "delta_vs_fp16": d, "delta_ci_low": d - 0.01, "delta_ci_high": d + 0.01}
                       for kv, d in (("auto", 0.0), ("kvarn_k4v2_g128", 0.0), ("turboquant_4bit_nc", -0.02))])
    f = frontier(pd.DataFrame(), ev, "gsm8k").set_index("kv_dtype")
    assert (f["cap_source"] == "bytes").all() and f["x"].isna().all()
    assert f.loc["auto", "cap"] == 1.0 and math.isclose(f.loc["kvarn_k4v2_g128", "cap"], 512 / 108)
    layers, tq = 36, 134  # Qwen3-8B: 36 layers, 4 of them 16-bit under TurboQuant
    assert math.isclose(f.loc["turboquant_4bit_nc", "cap"], 512 * layers / (512 * 4 + tq * (layers - 4)))
    # fp16: the same accuracy with less capacity; TurboQuant: less of both
    assert f["pareto"].to_dict() == {"auto": False, "turboquant_4bit_nc": False, "kvarn_k4v2_g128": True}


def test_pareto_mask():
    import pandas as pd

    pts = pd.DataFrame({"x": [1.0, 1.7, 1.5, 1.4], "y": [0.0, -1.0, -0.3, -3.5], "cap": [1, 4.5, 3.5, 2.9]})
    assert list(pareto_mask(pts, ["x", "y", "cap"])) == [True, True, True, False]


def test_errors_and_cli(both, tmp_path):
    with pytest.raises(KvarnError, match="does not exist"):
        build_report(tmp_path / "nope", tmp_path / "r")
    with pytest.raises(KvarnError, match="--task 'gsm8k' has no eval rows"):
        build_report(both, tmp_path / "r", task="gsm8k")
    r = run_cli("report", str(both), "--out", str(tmp_path / "cli"), "--task", "niah")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cli" / "index.html").is_file() and (tmp_path / "cli" / "frontier.png").is_file()
    r = run_cli("report", str(tmp_path / "empty"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_frontier_axes_name_their_runs_and_the_cpu():
    """Each frontier axis says which run its numbers come from; CPU (hf engine) throughput says it is no GPU's."""
    import pandas as pd

    from kvarn.report.data import frontier
    from kvarn.report.plots import _source

    rows = [bench_row("qwen3-8b", kv, output_tok_s=t, run_id="benchrun01") for kv, t in
            (("auto", 1000.0), ("kvarn_k4v2_g128", 1800.0))]
    cells = bench_cells(normalise_bench(pd.DataFrame(rows)))
    ev = pd.DataFrame([{"model": cells["model"].iloc[0], "tp": 1, "task": "gsm8k", "kv_dtype": kv,
                        "run_id": "evalrun02", "metric": "accuracy", "accuracy": 0.5, "delta_vs_fp16": d, "delta_ci_low": d - 0.01,
                        "delta_ci_high": d + 0.01} for kv, d in (("auto", 0.0), ("kvarn_k4v2_g128", -0.002))])
    f = frontier(cells, ev, "gsm8k")
    assert set(f["x_run"]) == {"benchrun01"} and set(f["y_run"]) == {"evalrun02"}
    assert _source(f, "y") == "run evalrun02" and _source(f, "x").startswith("run benchrun01")
    f["hf_device"] = "cpu"
    assert _source(f, "x").endswith("CPU (transformers): not a GPU's")
