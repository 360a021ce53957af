"""The transformers KV cache per format, shared by bench's and eval's hf engines."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvarn.engines.hf import kv_cache  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_fp16_is_transformers_cache_and_others_store_through_the_codec(tiny):
    from kvarn.method.hf_cache import KVCodecCache

    assert type(kv_cache("auto", tiny)) is transformers.DynamicCache
    c = kv_cache("kvarn_k4v2_g128", tiny)
    assert isinstance(c, KVCodecCache) and len(c.layers) == 4 and all(layer.keep_decoded for layer in c.layers)


def test_kept_decoded_copies_change_no_number(tiny):
    """keep_decoded decodes each stored unit once; decoding is deterministic, so the logits are the same."""
    from kvarn.method.hf_cache import KVCodecCache, cache_kwarg

    ids = torch.randint(0, 101, (1, 160), generator=torch.Generator().manual_seed(1))
    kw = cache_kwarg(tiny)

    def run(cache):
        with torch.no_grad():
            tiny(ids[:, :140], use_cache=True, **{kw: cache})
            return torch.cat([tiny(ids[:, t:t + 1], use_cache=True, **{kw: cache}).logits for t in range(140, 160)], 1)

    kept = run(kv_cache("kvarn_k4v2_g128", tiny))
    plain = run(KVCodecCache("kvarn_k4v2_g128", config=tiny.config))
    assert torch.equal(kept, plain)
