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


def _smi(monkeypatch, answers):
    """nvidia-smi answering each call with the next of `answers` (the last one repeats); the calls are counted."""
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, answers[min(len(calls), len(answers)) - 1], "")

    monkeypatch.setattr(gpus.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(gpus.subprocess, "run", fake_run)
    monkeypatch.setattr(gpus.time, "sleep", lambda s: None)
    return calls


BUSY = "0, GPU-aaaa1111, [N/A], 20000, 143771\n1, GPU-bbbb2222, [N/A], 143000, 143771\n"
FREE = "0, GPU-aaaa1111, [N/A], 143000, 143771\n1, GPU-bbbb2222, [N/A], 143000, 143771\n"


def test_engine_start_waits_until_the_engine_before_has_handed_its_memory_back(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    calls = _smi(monkeypatch, [BUSY, BUSY, FREE])
    assert gpus.wait_for_free_memory(0.9) == "" and len(calls) == 3
    # only the GPUs the engine takes: GPU 1 is free, GPU 0 (busy) is not in CUDA_VISIBLE_DEVICES=1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    calls = _smi(monkeypatch, [BUSY])
    assert gpus.wait_for_free_memory(0.9) == "" and len(calls) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # one rank on GPU 1 alone; two ranks need GPU 0 too
    calls = _smi(monkeypatch, [BUSY])
    assert gpus.wait_for_free_memory(0.9, count=1) == "" and len(calls) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")  # a UUID prefix, as CUDA accepts
    calls = _smi(monkeypatch, [BUSY, FREE])
    assert gpus.wait_for_free_memory(0.9) == "" and len(calls) == 2


def test_memory_never_freed_is_one_line_after_the_time_limit(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    _smi(monkeypatch, [BUSY])
    msg = gpus.wait_for_free_memory(0.9, count=2, timeout_s=0.0)
    assert msg == "GPU 0: 19.5 of 140.4 GiB free after 0 s, 0.90 wanted"


def test_no_wait_where_nvidia_smi_cannot_tell(monkeypatch):
    mig = "0, GPU-aaaa1111, Enabled, 100, 143771\n"
    for vis, answer in (("0", mig), ("MIG-4b2c8e1a-0000", BUSY), ("7", BUSY), ("0", "garbage\n")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", vis)
        _smi(monkeypatch, [answer])
        assert gpus.wait_for_free_memory(0.9, timeout_s=0.0) == ""
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    assert gpus.wait_for_free_memory(0.9, timeout_s=0.0) == ""
