"""KVCodecCache: identity reproduces the plain cache; serving semantics; real memory saving."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvarn.errors import KvarnError  # noqa: E402
from kvarn.method.codecs import get_codec  # noqa: E402
from kvarn.method.hf_cache import cache_kwarg as _cache_kwarg  # noqa: E402
from kvarn.method.hf_cache import KVCodecCache  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    m = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 101, (1, 300), generator=torch.Generator().manual_seed(1))
    return m, cfg, ids


def _chunked(m, ids, cache, chunk=64):
    kw = _cache_kwarg(m)
    with torch.no_grad():
        return torch.cat([m(ids[:, s:s + chunk], use_cache=True, **{kw: cache}).logits
                          for s in range(0, ids.shape[1], chunk)], 1)


def test_identity_cache_reproduces_plain_logits(tiny):
    m, cfg, ids = tiny
    ref = _chunked(m, ids, DynamicCache())
    got = _chunked(m, ids, KVCodecCache("auto", config=cfg))
    assert torch.equal(got, ref)
    with torch.no_grad():
        full = m(ids).logits
    assert torch.allclose(got, full, atol=1e-4)


def test_first_chunk_is_exact_then_quantized_cache_is_read(tiny):
    m, cfg, ids = tiny
    kw = _cache_kwarg(m)
    with torch.no_grad():
        full = m(ids[:, :200]).logits
        c = KVCodecCache("kvarn_k2v2_g128", config=cfg)
        first = m(ids[:, :200], use_cache=True, **{kw: c}).logits
        assert torch.equal(first, full)  # empty context: attends to its own raw K/V
        nxt = m(ids[:, 200:201], use_cache=True, **{kw: c}).logits
        ref = m(ids[:, :201]).logits[:, -1:]
    assert not torch.allclose(nxt, ref, atol=1e-5)  # the full tile 0..127 is read back quantized
    assert c.get_seq_length() == 201
    lay = c.layers[0]
    assert len(lay.payloads) == 1 and lay.keys.shape[-2] == 201 - 128  # one tile packed, 73 tokens 16-bit
    k, v = lay.read()
    assert k.shape == (1, 2, 201, 16)


def test_quantized_cache_state_after_own_tokens(tiny):
    """A later chunk attends to the cache AFTER its tokens were stored: a tile completed by this chunk is
    already quantized for this chunk's own queries."""
    m, cfg, ids = tiny
    kw = _cache_kwarg(m)
    codec = get_codec("kvarn_k2v2_g128")
    with torch.no_grad():
        c = KVCodecCache(codec, config=cfg, sink_tokens=0)  # (the sink would override positions 0..15)
        m(ids[:, :100], use_cache=True, **{kw: c})
        m(ids[:, 100:140], use_cache=True, **{kw: c})  # completes tile 0 (0..127)
    lay = c.layers[2]
    assert len(lay.payloads) == 1 and lay.keys.shape[-2] == 12
    k, _ = lay.read()
    kd, _ = codec.decode(lay.payloads[0])
    assert torch.equal(k[..., :128, :], kd.to(k.dtype))


def test_generate_and_memory_accounting(tiny):
    m, cfg, ids = tiny
    kw = _cache_kwarg(m)
    c = KVCodecCache("kvarn_k4v2_g128", config=cfg)
    with torch.no_grad():
        out = m.generate(ids[:, :250], max_new_tokens=10, do_sample=False, **{kw: c})
    assert out.shape == (1, 260) and c.get_seq_length() == 259
    mem = c.memory_bytes()
    # 6 layers x 2 KV heads x 2 tiles x record bytes (D=16) packed; 3 tokens 16-bit tail (counted at 2 bytes even
    # though this CPU model computes in fp32: the format's tail is 16-bit)
    rec = get_codec("kvarn_k4v2_g128").fmt.record_bytes(16)
    assert mem["packed"] == 6 * 2 * 2 * rec
    assert mem["tail"] == 6 * 2 * 2 * 3 * 16 * 2
    assert mem["window"] == 6 * 2 * 2 * (2 * 32) * 16 * 2  # the last two tiles' last 32 tokens
    assert mem["total"] == mem["packed"] + mem["tail"] + mem["sink"] + mem["window"]
    plain = 6 * 2 * 2 * 259 * 16 * 2  # the same tokens in an fp16 cache
    assert mem["total"] - mem["window"] < plain / 2 and mem["total"] < plain  # 64 window tokens of 259 weigh here


def test_sink_tokens_stay_16bit(tiny):
    m, cfg, ids = tiny
    kw = _cache_kwarg(m)
    c = KVCodecCache("kvarn_k2v2_g128", config=cfg, sink_tokens=4)
    with torch.no_grad():
        m(ids[:, :130], use_cache=True, **{kw: c})
        m(ids[:, 130:131], use_cache=True, **{kw: c})
    lay = c.layers[1]
    k, _ = lay.read()
    assert torch.equal(k[..., :4, :], lay.sink_k)
    dk, _ = lay.codec.decode(lay.payloads[0])
    assert not torch.equal(dk[..., :4, :].to(k.dtype), lay.sink_k)  # the quantized copy differs
    assert c.memory_bytes()["sink"] == 6 * 2 * 2 * 4 * 16 * 2  # layers x (K, V) x heads x tokens x D x 16-bit
    with pytest.raises(KvarnError):
        KVCodecCache("auto", num_layers=2, sink_tokens=-1)


def test_turboquant_boundary_layers_identity(tiny):
    _, cfg, _ = tiny
    c = KVCodecCache("turboquant_3bit_nc", config=cfg)
    kinds = [type(layer.codec).__name__ for layer in c.layers]
    assert kinds == ["IdentityCodec"] * 2 + ["TurboQuantCodec"] * 2 + ["IdentityCodec"] * 2


def test_keep_decoded_gives_identical_logits(tiny):
    m, cfg, ids = tiny
    a = _chunked(m, ids, KVCodecCache("kvarn_k4v2_g128", config=cfg))
    c = KVCodecCache("kvarn_k4v2_g128", config=cfg, keep_decoded=True)
    assert torch.equal(_chunked(m, ids, c), a)
    assert c.memory_bytes()["decoded"] > 0


def test_a_chunk_reads_the_stored_prefix_and_its_own_raw_tokens():
    """Serving semantics of a continuation chunk (as the backend's dense prefill path): positions before the chunk
    come back as stored (tiles quantized, the tail 16-bit), the chunk's own positions raw, also where the chunk
    completed a tile; a one-token step (decode) reads the stored state everywhere."""
    from kvarn.method.hf_cache import CodecLayer

    layer = CodecLayer(get_codec("kvarn_k4v2_g128"))
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(1, 2, 100, 64, generator=g), torch.randn(1, 2, 100, 64, generator=g)
    k1, v1 = torch.randn(1, 2, 60, 64, generator=g), torch.randn(1, 2, 60, 64, generator=g)
    assert layer.update(k0, v0)[0] is k0  # first chunk: raw
    k, v = layer.update(k1, v1)  # completes tile 0 (positions 0..127) inside the chunk
    assert k.shape[-2] == 160 and torch.equal(k[..., 100:, :], k1) and torch.equal(v[..., 100:, :], v1)
    stored_k, _ = layer.read()
    assert torch.equal(k[..., :100, :], stored_k[..., :100, :])
    assert not torch.equal(k[..., :100, :], k0)  # the prefix's tile is read back quantized
    kd, vd = torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g)
    k, _ = layer.update(kd, vd)
    assert torch.equal(k, layer.read()[0])


def test_turboquant_chunk_up_to_128_reads_its_own_tokens_quantized():
    """vLLM 0.26's TurboQuant backend runs a continuation chunk of <= 128 tokens through its decode kernel over the
    cache it has just written: the chunk's own K/V come back quantized. A 129-token chunk takes the dense path
    (the prefix dequantized, its own tokens raw); a first chunk is raw."""
    from kvarn.method.hf_cache import CodecLayer

    g = torch.Generator().manual_seed(0)
    kv = lambda n: (torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g))  # noqa: E731
    layer = CodecLayer(get_codec("turboquant_4bit_nc"))
    k0, v0 = kv(128)
    assert layer.update(k0, v0)[0] is k0
    k1, v1 = kv(128)
    k, v = layer.update(k1, v1)
    sk, sv = layer.read()
    assert torch.equal(k, sk) and torch.equal(v, sv) and not torch.equal(k[..., 128:, :], k1)
    k2, v2 = kv(129)
    k, v = layer.update(k2, v2)
    assert torch.equal(k[..., 256:, :], k2) and torch.equal(k[..., :256, :], layer.read()[0][..., :256, :])
    kvarn = CodecLayer(get_codec("kvarn_k4v2_g128"))
    kvarn.update(*kv(128))
    k3, v3 = kv(128)
    assert torch.equal(kvarn.update(k3, v3)[0][..., 128:, :], k3)  # KVarN's chunks read their own tokens raw


class _Tok:
    eos_token_id = 100

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_engine_first_token_comes_from_the_raw_prefill(tiny, monkeypatch, temperature):
    """--engine hf generation, as vLLM serves a prompt: the first token is drawn from the prompt's own prefill,
    whose (first) chunk reads its own tokens raw, so a quantized format gives the fp16 logits there; the tokens after
    it read the stored cache (here: 4-bit keys / 2-bit values), so the answers may part later, never at token 1."""
    import kvarn.eval.engines as E
    from kvarn.formats import get_format

    m, cfg, ids = tiny
    seen = []
    pick = E._pick_token
    monkeypatch.setattr(E, "_pick_token", lambda lg, t, p: (seen.append(lg.clone()), pick(lg, t, p))[1])
    eng = E.HFEngine("tiny", device="cpu", model=m, tokenizer=_Tok())
    params = E.GenParams(max_tokens=6, temperature=temperature, top_p=0.9 if temperature else 1.0)
    req = [E.GenRequest("a", 0, ids[0, :260].tolist(), seed=3)]
    out = {kv: next(iter(eng.generate(get_format(kv), req, params))) for kv in ("auto", "kvarn_k4v2_g128")}
    assert len(seen) == 2 and torch.allclose(seen[0], seen[1], atol=1e-5)
    assert out["auto"].text.split()[0] == out["kvarn_k4v2_g128"].text.split()[0]
    assert all(r.gen_tokens == 6 for r in out.values())


def test_pick_token_top_p_keeps_the_head_of_the_distribution():
    from kvarn.eval.engines import _pick_token

    lg = torch.tensor([4.0, 3.0, 0.0, -1.0, -2.0])  # softmax mass: ~0.71, 0.26, then 0.03 in the rest
    torch.manual_seed(0)
    draws = {int(_pick_token(lg, 1.0, 0.9)) for _ in range(200)}
    assert draws == {0, 1}
    assert int(_pick_token(lg, 0.0, 1.0)) == 0
