import json

import pytest

from kvarn.errors import KvarnError
from kvarn.shapes import bundled_models, resolve_model
from tests.helpers import run_cli


@pytest.mark.parametrize("name,layers,q,kv,d,params_b", [
    ("qwen3-8b", 36, 32, 8, 128, 8.19),
    ("qwen3-32b", 64, 64, 8, 128, 32.76),
    ("llama-3.1-8b", 32, 32, 8, 128, 8.03),
    ("smollm2-135m", 30, 9, 3, 64, 0.1345),
])
def test_bundled_shapes(name, layers, q, kv, d, params_b):
    s = resolve_model(name)
    assert (s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim) == (layers, q, kv, d)
    assert s.num_params() / 1e9 == pytest.approx(params_b, rel=0.002)


def test_hub_id_resolves_to_bundled_shape_and_local_folder(tmp_path):
    assert resolve_model("Qwen/Qwen3-32B").name == "qwen3-32b"
    assert resolve_model("Qwen/Qwen3-32B").hf_id == "Qwen/Qwen3-32B"
    cfg = json.loads(bundled_models()["qwen3-8b"].read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = resolve_model(str(tmp_path))
    assert s.source == "local" and s.num_layers == 36
    with pytest.raises(KvarnError, match="has no config.json"):
        resolve_model(str(tmp_path.parent))
    # a multimodal config keeps the decoder under text_config; a config without the fields is one clear error
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vlm", "text_config": cfg}))
    assert resolve_model(str(tmp_path)).num_q_heads == 32
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(KvarnError, match="lacks num_hidden_layers, num_attention_heads, vocab_size"):
        resolve_model(str(tmp_path))


def test_hf_cache_lookup(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--acme--Tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    cfg = json.loads(bundled_models()["smollm2-135m"].read_text())
    (snap / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    s = resolve_model("acme/Tiny")
    assert s.source == "hf-cache" and s.num_kv_heads == 3


def test_env_json():
    r = run_cli("env", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for key in ("kvarn_version", "git_sha", "python", "torch", "triton", "vllm", "cuda", "driver", "gpus", "gpu_count"):
        assert key in info


def test_env_lists_the_settings_and_a_bad_one_is_one_line():
    r = run_cli("env", env={"KVARN_SINK": "4"})
    assert r.returncode == 0 and "KVARN_SINK" in r.stdout and "KVARN_BALANCE_ITERS" in r.stdout, r.stderr
    r = run_cli("env", env={"KVARN_SINK": "many"})
    assert r.returncode == 2 and r.stderr.strip() == "error: KVARN_SINK='many': accepted values are an integer >= 0"
    assert "Traceback" not in r.stderr


def test_help_lists_all_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for c in ("capacity", "env", "bench", "eval", "report", "gate", "fidelity", "microbench", "suite"):
        assert c in r.stdout


@pytest.mark.parametrize("args,msg", [
    (["bench", "--bogus"], "No such option: --bogus"),
    (["results", "--out", "x"], "No such option: --out"),
    (["bench", "--requests", "many"], "Invalid value for '--requests'"),
])
def test_usage_errors_are_one_clean_message(args, msg):
    # Typer >= 0.25 raises its vendored click's exceptions (typer._click), not click's: both are usage errors here
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr and "Traceback" not in r.stderr


def test_gpus_come_from_nvidia_smi_without_touching_cuda(tmp_path, monkeypatch):
    # the bench orchestrator records GPUs without initializing CUDA itself (the engines it starts need the memory)
    from kvarn import provenance as P

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H200, 143771, 9.0'\necho '1, NVIDIA H100 80GB HBM3, 81559, 9.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    g = P.gpus()
    assert [x["name"] for x in g] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"] and g[0]["memory_gib"] == 140.4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [(x["index"], x["name"]) for x in P.gpus()] == [(0, "NVIDIA H100 80GB HBM3")]
