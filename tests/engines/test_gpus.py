"""GPU discovery without a CUDA context in this process: nvidia-smi, or CUDA in a child process for MIG."""
import subprocess
import sys

from kvarn.engines import gpus


def test_gpu_memory_comes_from_nvidia_smi_or_cuda_for_a_mig_instance(monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = "143771\n" if cmd[0] == "nvidia-smi" else "42949672960\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    gpus._device_total_bytes.cache_clear()
    monkeypatch.setattr(gpus.subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpus.gpu_total_bytes() == 143771 * 2**20 and calls[-1][:3] == ["nvidia-smi", "-i", "3"]
    assert gpus.gpu_total_bytes() == 143771 * 2**20 and len(calls) == 1  # asked once per device
    mig = "MIG-4b2c8e1a-0000-0000-0000-000000000000"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    assert gpus.gpu_total_bytes() == 40 * 2**30  # nvidia-smi -i takes no MIG UUID: CUDA in a child process
    assert calls[-1][0] == sys.executable and "mem_get_info" in calls[-1][-1]
    gpus._device_total_bytes.cache_clear()
    monkeypatch.setattr(gpus.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 9, "", "no GPU"))
    for dev in ("0", mig):  # unknown: vLLM profiles the memory itself
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", dev)
        assert gpus.gpu_total_bytes() is None
    gpus._device_total_bytes.cache_clear()


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    out = "0, NVIDIA H200, 9.0\n1, NVIDIA H200, 9.0\n2, NVIDIA H200, 9.0\n"
    monkeypatch.setattr(gpus.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(gpus.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, out, ""))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [g["index"] for g in gpus.visible_gpus()] == ["0", "2"]
    assert gpus.visible_gpus()[0] == {"index": "0", "name": "NVIDIA H200", "capability": "9.0"}
