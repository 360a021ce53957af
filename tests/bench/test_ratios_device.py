"""The FP16 row a ratio was taken against names the device that ran it: its GPU, else the hf engine's device (a
machine without a GPU runs the hf engine on the CPU and records no GPU name)."""
import pandas as pd

from kvarn.bench.ratios import fp16_reference, ratios, with_ratios
from kvarn.report.fixtures import bench_row
from kvarn.results import ResultsStore
from tests.helpers import run_cli

CFG = dict(engine="hf", mode="offline", burst=544, prompt_len=512, output_len=32, requests=2)


def _rows(**device):
    return [bench_row("HuggingFaceTB/SmolLM2-135M-Instruct", kv, output_tok_s=t, run_id="r1", row_id=f"row-{kv}",
                      provenance={}, **device, **CFG) for kv, t in (("auto", 15.0), ("kvarn_k4v2_g128", 12.0))]


def test_a_cpu_fp16_row_is_named_by_its_device():
    fp16, cand = _rows(hf_device="cpu", gpu_name="")
    assert ratios(fp16, fp16)["fp16_gpu"] == "cpu"
    assert ratios(cand, fp16_reference(cand, [fp16, cand]))["fp16_gpu"] == "cpu"
    out = with_ratios(pd.DataFrame([fp16, cand])).set_index("kv_dtype")
    assert set(out["fp16_gpu"]) == {"cpu"}


def test_a_gpu_name_wins_over_the_hf_device():
    fp16, cand = _rows(hf_device="cuda", gpu_name="NVIDIA H200")
    assert ratios(cand, fp16_reference(cand, [fp16, cand]))["fp16_gpu"] == "NVIDIA H200"


def test_readme_table_names_the_cpu(tmp_path):
    ResultsStore(tmp_path).append(with_ratios(pd.DataFrame(_rows(hf_device="cpu", gpu_name=""))).to_dict("records"))
    r = run_cli("results", str(tmp_path), "--table", "readme")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "| kvarn_k4v2_g128 |" in ln)
    assert line.rstrip().endswith("row-auto · r1 · cpu |") and "?" not in line
