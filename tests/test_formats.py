import pytest

from kvarn.errors import KvarnError
from kvarn.formats import REGISTRY, get_format, kvarn_record_bytes, parse_formats


@pytest.mark.parametrize("name,expected", [
    ("auto", (256, 512, 1024)),
    ("fp8", (128, 256, 512)),
    ("turboquant_k8v4", (100, 196, 388)),
    ("turboquant_4bit_nc", (70, 134, 262)),
    ("turboquant_k3v4_nc", (62, 118, 230)),
    ("turboquant_3bit_nc", (54, 102, 198)),
    ("kvarn_k4v2_g128", (57, 108, 210)),
    ("kvarn_k4v4_g128", (73, 140, 274)),
    ("kvarn_k4v2_g64", (60, 114, 222)),
    ("kvarn_k2v2_g128", (41, 76, 146)),
])
def test_slot_bytes_per_head_dim(name, expected):
    f = get_format(name)
    assert tuple(f.slot_bytes(d) for d in (64, 128, 256)) == expected


def test_kvarn_record_layout_exact():
    # method note: 8192 packed keys + 768 key vectors + 4096 packed values + 768 value vectors
    assert kvarn_record_bytes(128, 128, 4, 2) == 13824
    assert get_format("kvarn_k4v2_g128").record_bytes(128) == 13824
    assert get_format("kvarn_k4v2_g128").record_bytes(64) % 16 == 0
    for f in REGISTRY.values():
        if f.family == "kvarn":
            for d in (64, 128, 256):
                assert f.record_bytes(d) % 16 == 0
                assert f.record_bytes(d) == f.slot_bytes(d) * f.group
    # fp16 ratio of the default preset: 512 / 108
    assert 512 / get_format("kvarn_k4v2_g128").slot_bytes(128) == pytest.approx(4.74, abs=0.01)


def test_boundary_layers():
    tq = get_format("turboquant_k3v4_nc")
    assert [i for i in range(36) if tq.is_16bit_layer(i, 36)] == [0, 1, 34, 35]
    assert [i for i in range(3) if tq.is_16bit_layer(i, 3)] == [0, 2]  # n = min(2, L // 2)
    assert not any(get_format("kvarn_k4v2_g128").is_16bit_layer(i, 36) for i in range(36))
    assert get_format("fp8").model_dtypes == ("bfloat16",)
    assert get_format("kvarn_k4v2_g128").block_size == 128
    assert get_format("kvarn_k4v2_g64").block_size == 64


def test_lookup_and_errors():
    assert get_format("FP16").name == "auto"
    assert [f.name for f in parse_formats("auto, fp8,auto")] == ["auto", "fp8"]
    assert len(parse_formats("all")) == len(REGISTRY)
    with pytest.raises(KvarnError, match="unknown kv dtype 'fp9'.*accepted: auto"):
        get_format("fp9")
    with pytest.raises(KvarnError, match="model dtype 'float16'"):
        get_format("fp8").check_model_dtype("float16")
    with pytest.raises(KvarnError, match="model dtype 'float16'"):  # vLLM's other spelling
        get_format("fp8").check_model_dtype("half")
    get_format("kvarn_k4v2_g128").check_model_dtype("half")
    get_format("fp8").check_model_dtype("auto")


def test_balance_iterations_are_a_format_property(monkeypatch):
    """The reference quantizer and the store kernels take the format's balancing iterations by default
    (KVARN_BALANCE_ITERS changes the method for both); an explicit iters still wins."""
    import dataclasses

    import torch

    from kvarn.method.reference import quantize_tiles

    fmt = get_format("kvarn_k4v2_g64")
    assert fmt.balance_iters == 3 and get_format("fp8").balance_iters == 3
    k = torch.randn(2, 2, 64, 64)
    k[..., 3] *= 30.0
    v = torch.randn(2, 2, 64, 64)
    eight = dataclasses.replace(fmt, balance_iters=8)
    assert torch.equal(quantize_tiles(k, v, eight), quantize_tiles(k, v, fmt, iters=8))
    assert torch.equal(quantize_tiles(k, v, fmt), quantize_tiles(k, v, fmt, iters=3))
    assert not torch.equal(quantize_tiles(k, v, eight), quantize_tiles(k, v, fmt))
