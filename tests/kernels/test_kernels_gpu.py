"""GPU checks of the Triton kernels (compiled path: bf16 tensor-core dots, real sizes, CUDA-graph capture).
Run on the device: python -m pytest -q -m gpu tests/kernels/test_kernels_gpu.py"""
from __future__ import annotations

import math

import pytest
import torch

from kvarn.formats import get_format, kvarn_formats  # noqa: F401
from tests.kernels.helpers import decode_reference, paged_setup, prefill_reference, rel_err, window_lens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


# every preset at D=128, the default preset at D=64 and 256 (each variant is a separate Triton compile)
STORE_CASES = [(f.name, 128) for f in kvarn_formats()] + [("kvarn_k4v2_g128", 64), ("kvarn_k4v2_g128", 256)]
DECODE_CASES = [(f.name, 128, 32, 8) for f in kvarn_formats()] + [
    ("kvarn_k4v2_g128", 64, 8, 8), ("kvarn_k4v2_g128", 128, 24, 8), ("kvarn_k4v2_g128", 256, 8, 2),
    ("kvarn_k4v2_g128", 128, 64, 8)]


@pytest.mark.parametrize("D", [128, 256])
def test_gpu_step_store_writes_what_store_tiles_writes(D):
    """store_step_tiles (a prefill / mixed step's tiles read in place: new K/V views into one qkv buffer, earlier
    positions from the tail) = store_tiles of the same tiles assembled, byte for byte, at a prefill step's size."""
    from kvarn.kernels import store_step_tiles, store_tiles
    from kvarn.method.paged import step_tiles_torch

    fmt = get_format("kvarn_k4v2_g128")
    g, H, T = fmt.group, 8, 64
    gen = torch.Generator(device=DEV).manual_seed(7)
    n = T * g + 77
    qkv = torch.randn(n, 4 * H, D, device=DEV, generator=gen).bfloat16()
    k, v = qkv[:, 2 * H:3 * H], qkv[:, 3 * H:]
    tail_k = torch.randn(T, H, fmt.tail_rows, D, device=DEV, generator=gen).bfloat16()
    tail_v = torch.randn_like(tail_k)
    old = torch.randint(0, g, (T,), device=DEV, generator=gen, dtype=torch.int32)
    old[: T // 2] = 0  # half the tiles whole in the new tokens, as a prefill step has them
    old[0] = 100  # and one whose position 0 would be token -23: those lanes must come from the tail alone
    first = torch.arange(T, device=DEV, dtype=torch.int64) * g + 77 - old.long()
    slots = torch.randperm(T, device=DEV, generator=gen).int()
    ids = torch.randperm(T + 1, device=DEV, generator=gen)[:T].int()
    ids[5] = -1
    got = torch.zeros(T + 1, H, fmt.record_bytes(D), dtype=torch.uint8, device=DEV)
    want = got.clone()
    store_step_tiles(k, v, tail_k, tail_v, got, ids, first, old, slots, fmt)
    store_tiles(*step_tiles_torch(k, v, tail_k, tail_v, first, old, slots, g), want, ids, fmt)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name,D", STORE_CASES)
def test_gpu_store_matches_reference(name, D):
    from kvarn.kernels import store_tiles
    from kvarn.method.reference import dequantize_tiles, quantize_tiles, unpack_records

    fmt = get_format(name)
    T, H = 16, 4
    k = torch.randn(T, H, fmt.group, D, device=DEV) * 3
    k[..., 5] *= 40.0
    v = torch.randn(T, H, fmt.group, D, device=DEV)
    k, v = k.bfloat16(), v.bfloat16()
    cache = torch.zeros(T + 1, H, fmt.record_bytes(D), dtype=torch.uint8, device=DEV)
    ids = torch.arange(T, dtype=torch.int32, device=DEV) + 1
    ids[3] = -1
    store_tiles(k, v, cache, ids, fmt)
    keep = ids >= 0
    got, ref = cache[ids[keep].long()], quantize_tiles(k[keep], v[keep], fmt)
    a, b = unpack_records(got, fmt, D), unpack_records(ref, fmt, D)
    codes = torch.cat([(a["qK"] == b["qK"]).flatten(), (a["qV"] == b["qV"]).flatten()]).float().mean().item()
    assert codes > 0.997, codes
    assert torch.count_nonzero(cache[0]) == 0 and torch.count_nonzero(cache[4]) == 0
    kd, vd = dequantize_tiles(got, fmt, D)
    kr, vr = dequantize_tiles(ref, fmt, D)
    assert rel_err(kd, kr) < 0.06 and rel_err(vd, vr) < 0.06
    assert rel_err(vd, v[keep]) <= rel_err(vr, v[keep]) * 1.05 + 1e-6


def test_gpu_store_decode_equals_store_tiles_and_captures():
    """store_decode (the decode step's KV write inside a full CUDA graph) = tail write + store_tiles of the
    completed tiles, bit for bit, replayed from a captured graph with new seq_lens / slots in the same buffers."""
    from kvarn.kernels import store_decode, store_tiles

    fmt = get_format("kvarn_k4v2_g128")
    g, D, H, B, S = fmt.group, 128, 8, 6, 10
    gen = torch.Generator(device=DEV).manual_seed(0)
    tail_k = torch.randn(S + 1, H, g, D, device=DEV, generator=gen).bfloat16()
    tail_v = torch.randn(S + 1, H, g, D, device=DEV, generator=gen).bfloat16()
    cache = torch.zeros(64, H, fmt.record_bytes(D), dtype=torch.uint8, device=DEV)
    bt = torch.randperm(60, device=DEV, generator=gen)[:B * 8].view(B, 8).int() + 1
    seq = torch.zeros(B, dtype=torch.int32, device=DEV)
    slots = torch.zeros(B, dtype=torch.int32, device=DEV)
    k = torch.zeros(B, H, D, device=DEV, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    run = lambda: store_decode(k, v, cache, bt, seq, tail_k, tail_v, slots, fmt)  # noqa: E731
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    seq.copy_(torch.tensor([128, 5, 256, 0, 1, 383], dtype=torch.int32))  # row 3: padding
    slots.copy_(torch.tensor([2, 7, 4, 10, 0, 9], dtype=torch.int32))
    k.copy_(torch.randn(B, H, D, device=DEV, generator=gen).bfloat16())
    v.copy_(torch.randn(B, H, D, device=DEV, generator=gen).bfloat16())
    want_k, want_v, want_cache = tail_k.clone(), tail_v.clone(), cache.clone()
    done = []
    for b, (s, sl) in enumerate(zip(seq.tolist(), slots.tolist())):
        if s:
            want_k[sl, :, (s - 1) % g] = k[b]
            want_v[sl, :, (s - 1) % g] = v[b]
            if s % g == 0:
                done.append((b, sl, int(bt[b, s // g - 1])))
    ids = torch.tensor([d[2] for d in done], dtype=torch.int32, device=DEV)
    rows = [d[1] for d in done]
    store_tiles(want_k[rows], want_v[rows], want_cache, ids, fmt)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tail_k, want_k) and torch.equal(tail_v, want_v)
    assert len(done) == 2 and torch.equal(cache, want_cache)


# the default and the previous one (token-row kernel), named: no run-time tuning, one compile per config and case
# + pipe 1, the tail in the records launch, that with programmatic dependent launches



@pytest.mark.parametrize("name,D,Hq,Hk", DECODE_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decode_matches_reference(name, D, Hq, Hk, dtype):
    """The compiled decode kernel (GQA groups 4, 1, 3 take the one-MMA key split, whose lane shuffle assumes the
    mma.sync accumulator layout: a wrong assumption mixes query heads, errors ~1e-1; group 8 in the 64/8-head case
    takes two key MMAs) against the fp32 reference."""
    from kvarn.kernels import decode_attention

    fmt = get_format(name)
    seq = [1000, 0, 4 * fmt.group, 37, 2 * fmt.group + 5]
    st = paged_setup(fmt, D, Hk, seq, dtype, device=DEV)
    q = (torch.randn(len(seq), Hq, D, device=DEV) * 2).to(dtype)
    scale = 1 / math.sqrt(D)
    ref = decode_reference(q, st, fmt, D, scale)
    for splits in (1, 4, None):
        out = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                               st["tail_slots"], fmt, scale, num_splits=splits,
                               out=torch.empty(q.shape, dtype=torch.float32, device=DEV))
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-3, (splits, rel_err(out, ref))
        assert torch.count_nonzero(out[1]) == 0


def test_gpu_decode_feeds_its_measured_occupancy_to_the_split_heuristic(monkeypatch):
    """The first launch measures the compiled records kernel's programs per SM; later calls size their splits with
    it instead of the default guess of 4."""
    from kvarn.kernels import decode

    monkeypatch.setattr(decode, "_PROGRAMS_PER_SM", {})  # as in a fresh process: nothing measured yet
    measured, asked = [], []
    real_measure, real_splits = decode.programs_per_sm, decode.default_num_splits

    def measure(kernel, dev):
        measured.append(real_measure(kernel, dev))
        return 7  # not the default 4: the next call shows whether it is used

    monkeypatch.setattr(decode, "programs_per_sm", measure)
    monkeypatch.setattr(decode, "default_num_splits", lambda *a: asked.append(a[4]) or real_splits(*a))
    fmt, D = get_format("kvarn_k4v2_g128"), 128
    st = paged_setup(fmt, D, 2, [700, 300], torch.bfloat16, device=DEV)
    q = torch.randn(2, 8, D, device=DEV).to(torch.bfloat16)
    for _ in range(2):
        decode.decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                                st["tail_slots"], fmt, 1 / math.sqrt(D))
    assert len(measured) == 1 and 1 <= measured[0] <= 32, measured  # 254 registers on 2 warps: 4
    assert asked == [4, 7], asked


def test_gpu_decode_cuda_graph_capture():
    """A captured step follows the per-step seq_lens; three calls back to back in one graph (scratch reused from
    call to call) each match the reference: with programmatic dependent launches every kernel waits for the
    previous one before it touches memory."""
    from kvarn.kernels import decode_attention

    fmt = get_format("kvarn_k4v2_g128")
    D, Hq, Hk = 128, 32, 8
    st = paged_setup(fmt, D, Hk, [700, 300, 0, 129], torch.bfloat16, device=DEV)
    qs = [torch.randn(4, Hq, D, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    outs = [torch.empty_like(q) for q in qs]

    def step():
        for q, out in zip(qs, outs):
            decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                             st["tail_slots"], fmt, 1 / math.sqrt(D), num_splits=4, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    # per-step change; every full tile a row now covers has a block (the table was built for the first lengths:
    # row 2 had none, so it stays empty, as a graph-padding row)
    st["seq_lens"].copy_(torch.tensor([650, 0, 0, 250], dtype=torch.int32, device=DEV))
    for o in outs:
        o.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for q, out in zip(qs, outs):
        ref = decode_reference(q, st, fmt, D, 1 / math.sqrt(D))
        assert rel_err(out, ref) < 8e-3
        assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[2]) == 0


@pytest.mark.parametrize("name,D", [("kvarn_k4v2_g128", 128), ("kvarn_k4v4_g128", 128), ("kvarn_k4v2_g64", 64),
                                    ("kvarn_k4v2_g128", 256), ("kvarn_k4v4_g128", 256)])  # D=256: 176-224 KiB smem
def test_gpu_dequantize_to_rows_matches_reference(name, D):
    from kvarn.kernels import dequantize_to_rows
    from kvarn.method.reference import dequantize_tiles, quantize_tiles

    fmt = get_format(name)
    g, H, T = fmt.group, 8, 16
    k = torch.randn(T, H, g, D, device=DEV) * 3
    k[..., 5] *= 40.0
    v = torch.randn(T, H, g, D, device=DEV)
    recs = quantize_tiles(k, v, fmt)
    cache = torch.zeros(T + 4, H, fmt.record_bytes(D), dtype=torch.uint8, device=DEV)
    blocks = torch.randperm(T + 4, device=DEV)[:T].int()
    cache[blocks.long()] = recs
    dst = torch.randperm(T, device=DEV).long() * g
    k_out = torch.empty(T * g, H, D, device=DEV, dtype=torch.bfloat16)
    v_out = torch.empty_like(k_out)
    dequantize_to_rows(cache, blocks, dst, k_out, v_out, fmt)
    kr, vr = dequantize_tiles(recs, fmt, D)
    idx = (dst[:, None] + torch.arange(g, device=DEV)[None, :]).reshape(-1)
    assert rel_err(k_out[idx].float(), kr.transpose(1, 2).reshape(-1, H, D)) < 5e-3
    assert rel_err(v_out[idx].float(), vr.transpose(1, 2).reshape(-1, H, D)) < 5e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_dense_prefill_matches_reference(dtype):
    """The dense prefill path on the GPU: records dequantized + tail copied into 16-bit K/V, then vLLM's FlashAttention
    varlen (bottom-right causal) when importable, else the torch varlen; vs the fp32 reference on the same cache."""
    import numpy as np

    from kvarn.vllm_plugin import dense_prefill
    from kvarn.vllm_plugin.step_plan import continuation_plan

    fmt = get_format("kvarn_k4v2_g128")
    D, Hq, Hk = 128, 32, 8
    seq, qlens = [1000, 300, 77, 520], [600, 3, 77, 1]
    st = paged_setup(fmt, D, Hk, seq, dtype, device=DEV)
    qsl_h = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int64)
    q = (torch.randn(int(qsl_h[-1]), Hq, D, device=DEV) * 2).to(dtype)
    scale = 1 / math.sqrt(D)
    ref = prefill_reference(q, torch.from_numpy(qsl_h), st, fmt, D, scale)
    plan = continuation_plan(qsl_h, seq, st["tail_slots"].cpu().numpy(), st["block_table"], fmt.group)
    varlen = None
    try:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

        ver = get_flash_attn_version(head_size=D)

        def varlen(q_, k_, v_, cu, max_len, cu_k=None, max_k=None, out=None):
            return flash_attn_varlen_func(q=q_, k=k_, v=v_, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=max_len,
                                          max_seqlen_k=max_k, softmax_scale=scale, causal=True, out=out,
                                          **({} if ver is None else {"fa_version": ver}))
    except Exception:  # noqa: BLE001 - no vLLM: the torch varlen on the GPU still checks the materialization
        pass
    out = dense_prefill.dense_prefill(plan, q, st["cache"], st["block_table"], st["tail_k"], st["tail_v"], fmt, scale,
                                      varlen)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out.float(), ref) < 1e-2  # K/V rounded to 16 bits (and FA rounds p to 16 bits)
    # the step's output written in place, one group of rows at a time (key_budget 1: each row a group of its own)
    plan.prepared.clear()
    buf = torch.full_like(q, float("nan"))
    got = dense_prefill.dense_prefill(plan, q, st["cache"], st["block_table"], st["tail_k"], st["tail_v"], fmt, scale,
                                      varlen, key_budget=1, out=buf)
    assert got is buf and torch.isfinite(buf.float()).all()
    # the same arithmetic over other groupings: the two differ by the last bit of some 16-bit roundings
    assert rel_err(buf.float(), out.float()) < 2 * torch.finfo(dtype).eps


def test_gpu_step_ms_replays_the_layers_from_one_graph():
    """microbench store times a step as one CUDA graph of `layers` back-to-back calls: every replay runs them all."""
    from kvarn.bench.microbench import step_ms

    x = torch.zeros(1, device=DEV)
    ms = step_ms(lambda: x.add_(1), 5, torch.device(DEV), iters=7, warmup=2)
    torch.cuda.synchronize()
    assert x.item() == 2 + 5 * (1 + 7)  # 2 eager warm-ups, then (1 warm-up + 7 timed) replays of 5 calls
    assert 0 < ms < 5.0


def test_gpu_paired_ms_replays_graphs_in_turn_and_falls_back_when_capture_fails():
    """microbench decode times ours and the baseline as CUDA graphs of `calls` back-to-back calls, replayed in turn; a
    fn that cannot be captured (it syncs) is timed call by call in the same rotation, and the others still run."""
    from kvarn.bench.microbench import paired_timings

    x, y, z = (torch.zeros(1, device=DEV) for _ in range(3))

    def syncs():
        z.add_(1)
        z.item()  # a host sync: not capturable

    timed = paired_timings([lambda: x.add_(1), lambda: y.add_(2), syncs], torch.device(DEV), iters=5, calls=4,
                           warmup=2)
    torch.cuda.synchronize()
    ms = [t for t, _ in timed]
    assert [h for _, h in timed] == ["CUDA graph of 4 calls, in-turn"] * 2 + ["call by call (not capturable), in-turn"]
    assert x.item() == 2 + 4 * (1 + 5)  # 2 eager warm-ups, then (1 untimed + 5 timed) replays of 4 calls
    assert y.item() == 2 * (2 + 4 * (1 + 5))
    assert z.item() >= 2 + 1 + 5  # eager calls (plus whatever ran before the capture failed)
    assert len(ms) == 3 and all(0 < m < 5.0 for m in ms)


@pytest.mark.parametrize("order", ["blocks", "gap"])
def test_gpu_paired_timings_other_orders_replay_each_graph_as_often(order):
    """--timing blocks (A-B-B-A blocks, iters // 2 replays each) and gap (in turn, idle before each): every fn is
    still replayed the same number of times, and the order is named in how it was timed."""
    from kvarn.bench.microbench import paired_timings

    x, y = torch.zeros(1, device=DEV), torch.zeros(1, device=DEV)
    timed = paired_timings([lambda: x.add_(1), lambda: y.add_(1)], torch.device(DEV), iters=6, calls=3, warmup=1,
                           order=order)
    torch.cuda.synchronize()
    assert [h for _, h in timed] == [f"CUDA graph of 3 calls, {order}"] * 2
    assert x.item() == y.item() == 1 + 3 * (1 + 6)  # blocks: two blocks of 3 timed replays
    assert all(0 < t < 5.0 for t, _ in timed)


# ------------------------------------------------------------------------------------------------ attention sink

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_sink_matches_reference(dtype):
    """Compiled record kernels skip the sink's positions and the tensor-core tail kernel reads the sink rows; a row
    with sink_lens 0 (a prefix hit) reads the records there."""
    from kvarn.kernels import decode_attention

    fmt = get_format("kvarn_k4v2_g128")
    gen = torch.Generator().manual_seed(21)
    lens = [0, 5, 16, 100, 128, 300, 2100, 700]
    st = paged_setup(fmt, 128, 8, lens, dtype, device=DEV, gen=gen, sink=16)
    q = (torch.randn(len(lens), 32, 128, generator=gen) * 2).to(dtype).to(DEV)
    sl = torch.full((len(lens),), 16, dtype=torch.int32, device=DEV)
    sl[-1] = 0
    # request_kv's rows read the window where they own their slot's sink (win_lens > 0), as the builder's tags give
    wl = window_lens(sl, fmt)
    cpu = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
    from kvarn.method.reference import reference_attention
    from tests.kernels.helpers import request_kv

    ref = torch.stack([torch.zeros(32, 128) if s == 0 else
                       reference_attention(q[b].float().cpu()[:, None], *request_kv(cpu, fmt, 128, b, int(sl[b])),
                                           128 ** -0.5)[:, 0] for b, s in enumerate(lens)])
    out = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                           st["tail_slots"], fmt, 128 ** -0.5, out=torch.empty(q.shape, device=DEV), sink_lens=sl,
                           win_lens=wl)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3


def test_gpu_store_decode_with_sink():
    from kvarn.kernels import store_decode, store_tiles

    fmt = get_format("kvarn_k4v2_g128")
    # store_decode keeps the first 16 tokens in the sink rows, the first tile's last 32 in its window half, and
    # stores the first tile as store_tiles does
    n, H = 130, 2
    k = torch.randn(n, H, 128, device=DEV).bfloat16()
    v = torch.randn(n, H, 128, device=DEV).bfloat16()
    cache = torch.zeros(3, H, fmt.record_bytes(128), dtype=torch.uint8, device=DEV)
    tk = torch.zeros(2, H, fmt.tail_rows, 128, device=DEV, dtype=torch.bfloat16)
    tv = torch.zeros_like(tk)
    bt = torch.tensor([[1, 2]], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    for p in range(n):
        store_decode(k[p:p + 1], v[p:p + 1], cache, bt, torch.tensor([p + 1], dtype=torch.int32, device=DEV),
                     tk, tv, slots, fmt)
    assert torch.equal(tk[1, :, 128:144], k[:16].transpose(0, 1))
    assert torch.equal(tv[1, :, 128:144], v[:16].transpose(0, 1))
    assert torch.equal(tk[1, :, 144:176], k[96:128].transpose(0, 1)) and not tk[1, :, 176:].any()
    want = torch.zeros(1, H, fmt.record_bytes(128), dtype=torch.uint8, device=DEV)
    store_tiles(k[:128].transpose(0, 1)[None].contiguous(), v[:128].transpose(0, 1)[None].contiguous(), want,
                torch.tensor([0], dtype=torch.int32, device=DEV), fmt)
    assert torch.equal(cache[1], want[0])


def test_gpu_decode_sink_lens_cuda_graph_replay():
    """A captured decode step reads the persistent sink_lens and win_lens buffers at replay: the builder's per-step
    values (a prefix hit's 0) change the output as the reference says, without a new capture."""
    from kvarn.kernels import decode_attention
    from kvarn.method.reference import reference_attention
    from tests.kernels.helpers import request_kv

    fmt = get_format("kvarn_k4v2_g128")
    D, Hq, Hk = 128, 32, 8
    lens = [700, 300, 129]
    st = paged_setup(fmt, D, Hk, lens, torch.bfloat16, device=DEV, sink=16)
    q = torch.randn(3, Hq, D, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(q.shape, device=DEV)
    sl = torch.full((3,), 16, dtype=torch.int32, device=DEV)
    wl = torch.full((3,), fmt.window_tokens, dtype=torch.int32, device=DEV)  # persistent too, as the builder's

    def step():
        decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                         st["tail_slots"], fmt, 1 / math.sqrt(D), num_splits=4, out=out, sink_lens=sl, win_lens=wl)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    cpu = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
    for vals in ([16, 16, 16], [0, 16, 0], [16, 0, 5]):
        sl.copy_(torch.tensor(vals, dtype=torch.int32, device=DEV))
        wl.copy_(window_lens(sl, fmt))
        g.replay()
        torch.cuda.synchronize()
        ref = torch.stack([reference_attention(q[b].float().cpu()[:, None], *request_kv(cpu, fmt, D, b, vals[b]),
                                               1 / math.sqrt(D))[:, 0] for b in range(3)])
        assert rel_err(out, ref) < 1e-3, vals


def test_gpu_flush_layers_equals_store_tiles_per_layer():
    """flush_layers (every layer's pending tiles in one launch, layers reached through an address table) writes the
    records store_tiles writes layer by layer, compiled at the shipped shape (D=128, bf16 tails with sink rows)."""
    from kvarn.kernels import store_tiles
    from kvarn.kernels.store import flush_layers
    from kvarn.method.reference import dequantize_tiles, unpack_records

    fmt = get_format("kvarn_k4v2_g128")
    g, D, H, L, S, nb = fmt.group, 128, 8, 6, 9, 20
    gen = torch.Generator(device=DEV).manual_seed(3)
    tk = [(torch.randn(S, H, fmt.tail_rows, D, device=DEV, generator=gen) * 2).bfloat16() for _ in range(L)]
    tv = [torch.randn(S, H, fmt.tail_rows, D, device=DEV, generator=gen).bfloat16() for _ in range(L)]
    caches = [torch.zeros(nb, H, fmt.record_bytes(D), dtype=torch.uint8, device=DEV) for _ in range(L)]
    slots = torch.tensor([4, 1, 8], dtype=torch.int32, device=DEV)
    blocks = torch.tensor([3, -1, 17], dtype=torch.int32, device=DEV)
    flush_layers(tk, tv, caches, slots, blocks, fmt)
    for layer in range(L):
        ref = torch.zeros_like(caches[layer])
        live = blocks >= 0
        store_tiles(tk[layer][slots[live].long(), :, :g], tv[layer][slots[live].long(), :, :g], ref, blocks[live], fmt)
        got, want = caches[layer][[3, 17]], ref[[3, 17]]
        a, b = unpack_records(got, fmt, D), unpack_records(want, fmt, D)
        codes = torch.cat([(a["qK"] == b["qK"]).flatten(), (a["qV"] == b["qV"]).flatten()]).float().mean().item()
        assert codes > 0.999, (layer, codes)
        kd, vd = dequantize_tiles(got, fmt, D)
        kr, vr = dequantize_tiles(want, fmt, D)
        # the two launches may round a value on a code boundary the other way (fp32 reduction order): with at most
        # 0.1% of codes one step apart, rel_err <= sqrt(1e-3) * step / rms, and a step of a 128-sample Gaussian row
        # is ~5.2 sigma / 15 for 4-bit keys (0.35 sigma: 0.011), ~5.2 sigma / 3 for 2-bit values (1.7 sigma: 0.055)
        assert rel_err(kd, kr) < 0.012 and rel_err(vd, vr) < 0.06, layer
        for q in ("qK", "qV"):  # a flip is one step, never more
            assert (a[q].int() - b[q].int()).abs().max() <= 1, (layer, q)
        assert torch.count_nonzero(caches[layer][[b for b in range(nb) if b not in (3, 17)]]) == 0


def test_gpu_decode_defer_reads_the_completed_tile_from_the_tail():
    """decode_attention(defer=True), compiled: a tile completed at this step (its record not written: garbage here)
    is read from the tail's g rows by the tensor-core tail kernel; the other rows read as without deferral."""
    from kvarn.kernels import decode_attention
    from kvarn.method.reference import reference_attention
    from tests.kernels.helpers import request_kv

    fmt = get_format("kvarn_k4v2_g128")
    gen = torch.Generator().manual_seed(23)
    lens = [0, 128, 1024, 300, 129, 2048]
    st = paged_setup(fmt, 128, 8, lens, torch.bfloat16, device=DEV, gen=gen, sink=16)
    for b, s in enumerate(lens):
        if s and s % 128 == 0:
            st["cache"][st["block_table"][b, s // 128 - 1].long()] = 0xAB
    q = (torch.randn(len(lens), 32, 128, generator=gen) * 2).bfloat16().to(DEV)
    cpu = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
    ref = torch.stack([torch.zeros(32, 128) if s == 0 else
                       reference_attention(q[b].float().cpu()[:, None], *request_kv(cpu, fmt, 128, b, defer=True),
                                           128 ** -0.5)[:, 0] for b, s in enumerate(lens)])
    out = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                           st["tail_slots"], fmt, 128 ** -0.5, out=torch.empty(q.shape, device=DEV), defer=True)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3


def test_gpu_defer_flag_in_a_captured_graph():
    """One captured decode step (store_decode + decode_attention reading the device flag, as the backend captures it)
    replayed with the flag at 1 leaves the completed tile in the tail and reads it there; at 0 it stores it at once."""
    from kvarn.kernels import decode_attention, store_decode

    fmt = get_format("kvarn_k4v2_g128")
    gen = torch.Generator().manual_seed(29)
    lens = [128, 300, 0, 1024]
    st = paged_setup(fmt, 128, 8, lens, torch.bfloat16, device=DEV, gen=gen, sink=16)
    B = len(lens)
    q = (torch.randn(B, 32, 128, generator=gen) * 2).bfloat16().to(DEV)
    k = torch.randn(B, 8, 128, generator=gen).bfloat16().to(DEV)
    v = torch.randn(B, 8, 128, generator=gen).bfloat16().to(DEV)
    flag = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = torch.empty(q.shape, device=DEV)
    state0 = {n: st[n].clone() for n in ("cache", "tail_k", "tail_v")}

    def step():
        store_decode(k, v, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                     st["tail_slots"], fmt, defer=flag)
        decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                         st["tail_slots"], fmt, 128 ** -0.5, out=out, defer=flag)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    done = [int(st["block_table"][b, s // 128 - 1]) for b, s in enumerate(lens) if s and s % 128 == 0]
    results = {}
    for value in (1, 0):
        for n, t in state0.items():
            st[n].copy_(t)
        for blk in done:
            st["cache"][blk] = 0
        flag.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert all(bool(st["cache"][blk].any()) is (value == 0) for blk in done), value
        results[value] = out.clone()
    # eager twins: deferred (the tail read) and immediate
    for value in (1, 0):
        for n, t in state0.items():
            st[n].copy_(t)
        for blk in done:
            st["cache"][blk] = 0
        store_decode(k, v, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                     st["tail_slots"], fmt, defer=bool(value))
        want = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                                st["tail_slots"], fmt, 128 ** -0.5, out=torch.empty(q.shape, device=DEV),
                                defer=bool(value))
        assert rel_err(results[value], want) < 1e-5, value
