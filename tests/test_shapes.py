"""kvarn.shapes: a model's attention shape from a bundled name, a Hub id, a local folder or the Hugging Face cache."""
import json

import pytest

from kvarn.errors import KvarnError
from kvarn.shapes import bundled_models, resolve_model


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
