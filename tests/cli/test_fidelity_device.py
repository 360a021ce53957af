"""`kvarn fidelity --device`: a device this machine lacks, or no device at all, is one line and exit 2 before any
model loads; synthetic K/V go to the device asked for."""
import json

import pytest
import torch

from kvarn.method.fidelity import run_fidelity, synthetic_kv
from tests.helpers import cli

pytest.importorskip("transformers")


def _error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.strip()]


@pytest.mark.parametrize("model", ["synthetic", "smollm2-135m"])
def test_cuda_without_cuda_is_one_line_exit_2(model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = cli("fidelity", "--model", model, "--context", "256", "--device", "cuda")
    assert code == 2, out + err
    assert _error_lines(err) == ["error: --device 'cuda': torch sees no CUDA GPU here; accepted here: cpu"]
    assert "Traceback" not in err and "loading" not in err  # refused before the model loads


@pytest.mark.parametrize("value", ["foo", "cuda:x", "xpu"])
def test_unknown_device_is_one_line_naming_it_and_the_accepted_values(value):
    code, out, err = cli("fidelity", "--context", "256", "--device", value)
    assert code == 2, out + err
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"error: unknown --device {value!r}; accepted: cpu, cuda, cuda:N, mps")
    assert "here: cpu" in lines[0]


def test_a_cuda_index_past_the_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, out, err = cli("fidelity", "--context", "256", "--device", "cuda:2")
    assert code == 2, out + err
    assert _error_lines(err) == ["error: --device 'cuda:2': torch sees 2 CUDA GPU(s); accepted here: cpu, cuda, "
                                 "cuda:0, cuda:1"]


def test_synthetic_honours_the_device():
    code, out, err = cli("fidelity", "--context", "256", "--kv-dtype", "auto,kvarn_k4v2_g128", "--device", "CPU",
                         "--json")
    assert code == 0, err
    assert [json.loads(x)["kv_dtype"] for x in out.splitlines() if x.strip()] == ["auto", "kvarn_k4v2_g128"]
    _, info = run_fidelity("synthetic", "auto", context=256, device="cpu:0")
    assert info["device"] == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_synthetic_on_cuda_matches_cpu():
    lay = synthetic_kv(layers=1, t=256, device="cuda")[0]
    assert lay.k.is_cuda and lay.q.is_cuda
    on_gpu, _ = run_fidelity("synthetic", "auto,kvarn_k4v2_g128", context=256, device="cuda")
    on_cpu, _ = run_fidelity("synthetic", "auto,kvarn_k4v2_g128", context=256, device="cpu")
    for g, c in zip(on_gpu, on_cpu):
        for k, v in c.metrics.items():
            assert g.metrics[k] == pytest.approx(v, rel=1e-3, abs=1e-6), (c.kv_dtype, k)
