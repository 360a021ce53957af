"""The paged cache + tail the vLLM backend builds, and the fp32 oracle over it: shared by the kernel tests (CPU
through the interpreter, small sizes) and the GPU tests (real sizes)."""
from __future__ import annotations

import torch

from kvarn.method.reference import dequantize_tiles, quantize_tiles, reference_attention


def paged_setup(fmt, D, Hk, seq_lens, dtype=torch.float16, device="cpu", gen=None, spare_blocks=3, sink=0):
    """A random paged cache holding the full tiles of every request (reference-quantized), a 16-bit tail
    holding each request's partial tile, a shuffled block table and shuffled tail slots. sink > 0: the tails
    get `sink` more rows, the request's first positions 16-bit (a high-norm first token, as attention sinks
    have), which the attention must read instead of what the first tile's record holds there; the format's window
    rows (read with a sink, for the tile before the newest position's) are random too, louder than the records."""
    g = fmt.group
    B = len(seq_lens)
    n_full = [s // g for s in seq_lens]
    nb = sum(n_full) + spare_blocks
    max_blocks = max(1, max(-(-s // g) for s in seq_lens))
    k = torch.randn(nb, Hk, g, D, generator=gen) * 2
    k[..., 1] *= 8.0  # an outlier channel, as real keys have
    v = torch.randn(nb, Hk, g, D, generator=gen)
    cache = quantize_tiles(k, v, fmt).to(device)
    perm = torch.randperm(nb, generator=gen)
    bt = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b in range(B):
        bt[b, :n_full[b]] = perm[used:used + n_full[b]].to(torch.int32)
        used += n_full[b]
    S = B + 2
    rows = g + sink + (2 * fmt.window_tokens if sink else 0)
    tail_k = torch.randn(S, Hk, rows, D, generator=gen) * 2
    tail_v = torch.randn(S, Hk, rows, D, generator=gen)
    if sink:
        tail_k[:, :, g] *= 6.0
        tail_v[:, :, g] *= 4.0
        tail_v[:, :, g + sink:] *= 3.0
    tail_k, tail_v = tail_k.to(dtype), tail_v.to(dtype)
    slots = torch.randperm(S, generator=gen)[:B].to(torch.int32)
    return dict(cache=cache, block_table=bt.to(device), tail_k=tail_k.to(device), tail_v=tail_v.to(device),
                tail_slots=slots.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))


def request_kv(setup, fmt, D, b, sink_len=None, defer=False):
    """fp32 K, V [Hk, seq_len, D] of request b exactly as the cache + tail hold them (dequantized). defer: a tile
    completed at this step is still in the tail (rows [0, g)), its record not written yet."""
    g = fmt.group
    s = int(setup["seq_lens"][b])
    nf = (s - 1) // g if defer and s else s // g
    nt = s - nf * g
    cache = setup["cache"]
    Hk = cache.shape[1]
    ks, vs = [], []
    if nf:
        recs = cache[setup["block_table"][b, :nf].long()]  # [nf, Hk, R]
        kd, vd = dequantize_tiles(recs, fmt, D)
        ks.append(kd.permute(1, 0, 2, 3).reshape(Hk, nf * g, D))
        vs.append(vd.permute(1, 0, 2, 3).reshape(Hk, nf * g, D))
    slot = int(setup["tail_slots"][b])
    ks.append(setup["tail_k"][slot, :, :nt].float())
    vs.append(setup["tail_v"][slot, :, :nt].float())
    k, v = torch.cat(ks, 1), torch.cat(vs, 1)
    # the sink: once the first tile is quantized its first positions come from the 16-bit sink rows
    rows = setup["tail_k"].shape[2]
    W = fmt.window_tokens if rows > g else 0  # rows [0, g) alone: a plain tail
    sink = rows - g - 2 * W
    n = (sink if sink_len is None else min(sink_len, sink)) if nf else 0
    if n:
        k[:, :n] = setup["tail_k"][slot, :, g:g + n].float()
        v[:, :n] = setup["tail_v"][slot, :, g:g + n].float()
    # the window: with a sink, rows that own their slot read the last W positions of the tile before the newest
    # position's from its window half
    if W and sink and s > g and (sink_len is None or sink_len > 0):
        wt = (s - 1) // g - 1
        r = g + sink + (wt % 2) * W
        k[:, wt * g + g - W:wt * g + g] = setup["tail_k"][slot, :, r:r + W].float()
        v[:, wt * g + g - W:wt * g + g] = setup["tail_v"][slot, :, r:r + W].float()
    return k, v


def window_lens(sink_lens, fmt):
    """win_lens as request_kv reads the window: the format's window in a row that owns its sink, else 0."""
    return (sink_lens > 0).to(torch.int32) * fmt.window_tokens


def rel_err(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def decode_reference(q, setup, fmt, D, scale, defer=False):
    outs = []
    for b in range(q.shape[0]):
        if int(setup["seq_lens"][b]) == 0:
            outs.append(torch.zeros(q.shape[1], D, device=q.device))
            continue
        K, V = request_kv(setup, fmt, D, b, defer=defer)
        outs.append(reference_attention(q[b].float()[:, None], K, V, scale)[:, 0])
    return torch.stack(outs)


def prefill_reference(q, qsl, setup, fmt, D, scale):
    """fp32 oracle of continuation chunks: request b's queries qsl[b] .. qsl[b + 1] are its last positions and
    attend causally over the cache + tail as they hold them."""
    outs = []
    for b in range(len(qsl) - 1):
        a, e = int(qsl[b]), int(qsl[b + 1])
        if e == a:
            continue
        K, V = request_kv(setup, fmt, D, b)
        s = int(setup["seq_lens"][b])
        o = reference_attention(q[a:e].float().transpose(0, 1), K, V, scale, causal_offset=s - (e - a))
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)
