"""kvarn.provenance: what a result row records of the machine it ran on."""
from kvarn import provenance as P


def test_gpus_come_from_nvidia_smi_without_touching_cuda(tmp_path, monkeypatch):
    # the bench orchestrator records GPUs without initializing CUDA itself (the engines it starts need the memory)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H200, 143771, 9.0'\necho '1, NVIDIA H100 80GB HBM3, 81559, 9.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    g = P.gpus()
    assert [x["name"] for x in g] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"] and g[0]["memory_gib"] == 140.4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [(x["index"], x["name"]) for x in P.gpus()] == [(0, "NVIDIA H100 80GB HBM3")]
