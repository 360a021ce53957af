"""The vLLM backend's store and attention of one step, over plain tensors (no vLLM import; tested on CPU): each
piece dispatched to the Triton kernels of kvarn.kernels when the tensors live on CUDA, else to the PyTorch reference
of kvarn.method.paged (CPU tests; use_kernels=True runs the kernels there too, in the Triton interpreter, where
Triton is installed). CUDA tensors without importable kernels are an error: the reference there would be a silent
slowdown of every step. The step itself is planned by kvarn.vllm_plugin.step_plan; continuation chunks attend
through kvarn.vllm_plugin.dense_prefill.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..formats import KVFormat
from ..method.paged import cached_attention_torch, raw_attention_torch, step_tiles_torch, store_tiles_torch
from .common import kernel_lookup
from .dense_prefill import dense_prefill, into
from .step_plan import StepPlan


def _kernel(module: str, name: str, cuda: bool = False):
    """kvarn.kernels.<module>.<name>, or None where Triton is not installed (the torch reference runs instead).
    cuda: the tensors live on a GPU, where a missing kernel is an error, not a fallback. A kernel module that fails
    to import for another reason (a broken Triton build) raises as it is."""
    found = kernel_lookup(module, name)
    if isinstance(found, ImportError):
        if cuda:
            raise RuntimeError(f"kvarn: CUDA tensors need the Triton kernels, and kvarn.kernels.{module} does not "
                               f"import here ({found}); install the triton that vLLM pins") from found
        return None
    return found


def decode_kernels_available() -> bool:
    """The kernels of a decode step (the full-graph path) import here (False: Triton is not installed)."""
    return _kernel("store", "store_decode") is not None and _kernel("decode", "decode_attention") is not None


def _rows_of(x: torch.Tensor | None, rows):
    return None if x is None else x[rows]


def _host(x: torch.Tensor | None):
    return None if x is None else x.cpu().numpy()


def store(plan: StepPlan, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, tail_k: torch.Tensor,
          tail_v: torch.Tensor, fmt: KVFormat, iters: int | None = None, use_kernels: bool | None = None) -> None:
    """k, v [N, Hk, D] new tokens (N >= plan.num_tokens); cache uint8 [num_blocks, Hk, R]; tails
    [S+1, Hk, g + sink + 2W, D]. Complete tiles are quantized first (their earlier positions read from the tail),
    then the unfinished tiles' tokens go to the tail and the sink's and window's to their rows."""
    g = plan.group
    if tail_k.shape[2] != g + plan.sink + 2 * plan.window:
        raise ValueError(f"kvarn: tail buffers of {tail_k.shape[2]} rows, the plan wants {g} + sink {plan.sink} + "
                         f"window 2 x {plan.window}")
    kernels = k.is_cuda if use_kernels is None else use_kernels
    if plan.num_tiles:
        fn = _kernel("store", "prepare_step_tiles", k.is_cuda) if kernels else None
        if fn is not None:
            plan.launch(("store", fmt.name, iters), lambda *t: fn(*t, plan.tile_block_ids, plan.tile_first,
                                                                 plan.tile_old, plan.tile_slot, fmt, iters),
                        k, v, tail_k, tail_v, cache)
        else:
            tk, tv = step_tiles_torch(k, v, tail_k, tail_v, plan.tile_first, plan.tile_old, plan.tile_slot, g)
            store_tiles_torch(tk, tv, cache, plan.tile_block_ids, fmt, iters=iters)
    if plan.tail_tok is not None:
        fn = _kernel("rows", "prepare_write_tail_rows", k.is_cuda) if kernels else None
        if fn is not None:
            plan.launch("tail rows", lambda *t: fn(*t, plan.tail_tok, plan.tail_slot, plan.tail_pos), k, v, tail_k,
                        tail_v)
        else:
            tail_k[plan.tail_slot, :, plan.tail_pos] = k[plan.tail_tok].to(tail_k.dtype)
            tail_v[plan.tail_slot, :, plan.tail_pos] = v[plan.tail_tok].to(tail_v.dtype)


def attention(plan: StepPlan, q, k, v, out, cache, block_table, seq_lens_dev, tail_k, tail_v, fmt: KVFormat,
              scale: float, raw_varlen: Callable | None = None, use_kernels: bool | None = None) -> None:
    """Writes out[:num_tokens] ([N, Hq, D], q's dtype). raw_varlen(q, k, v, cu, max_len, cu_k=None, max_k=None,
    out=None) -> [n, Hq, D] is the fast exact path for rows without context and, with cu_k / max_k, for continuation
    chunks over their materialized K/V (vLLM's flash_attn_varlen_func; given `out`, it may write there, else its
    rows are copied in); None: the torch reference."""
    # 1. rows without prior context: raw Q/K/V (exact), over the token range from the first such row to the last
    if plan.raw_span is not None:
        a, e = plan.raw_span
        if raw_varlen is not None and out.dtype == q.dtype:  # FlashAttention writes q's dtype, in place
            dst = out[a:e]
            into(dst, raw_varlen(q[a:e], k[a:e], v[a:e], plan.raw_cu, plan.raw_max, out=dst))
        else:
            o = (raw_varlen(q[a:e], k[a:e], v[a:e], plan.raw_cu, plan.raw_max) if raw_varlen is not None else
                 raw_attention_torch(q[a:e], k[a:e], v[a:e], plan.raw_cu.cpu(), scale))
            out[a:e] = o.to(out.dtype)
    if plan.pure_prefill:
        return
    if use_kernels is None:
        use_kernels = q.is_cuda
    # 2. decode rows: one new token over the post-store cache (slices where they lead the batch, as vLLM orders it)
    if len(plan.dec_rows):
        n = plan.dec_prefix
        rows, tok = (slice(0, n), slice(0, n)) if n else (plan.dec_rows_t, plan.dec_tok)
        fn = _kernel("decode", "prepare_decode", q.is_cuda) if use_kernels else None
        if fn is not None:  # a leading slice of `out` is written in place
            qd = q[tok]
            o = out[tok] if n else torch.empty_like(qd)
            plan.launch(("decode", fmt.name, scale), lambda qd, c, tk, tv, o: fn(
                qd, c, block_table[rows], seq_lens_dev[rows], tk, tv, plan.tail_slots[rows], fmt, scale, out=o,
                sink_lens=_rows_of(plan.sink_lens, rows), win_lens=_rows_of(plan.win_lens, rows)),
                qd, cache, tail_k, tail_v, o)
            if not n:
                out[tok] = o.to(out.dtype)
        else:
            r = plan.dec_rows
            o = cached_attention_torch(q[tok], cache, block_table[rows], np.arange(len(r) + 1), plan.seq_lens[r],
                                       tail_k, tail_v, plan.tail_slots_np[r], fmt, scale,
                                       _host(_rows_of(plan.sink_lens, rows)), _host(_rows_of(plan.win_lens, rows)))
            out[tok] = o.to(out.dtype)
    # 3. continuation chunks (chunked prefill, prefix-cache hits, spec-decode verify): several new tokens over the
    # post-store cache, through materialized 16-bit K/V (kvarn.vllm_plugin.dense_prefill)
    if len(plan.cont_rows):
        tok = slice(*plan.cont_span) if plan.cont_span is not None else plan.cont_tok
        # a token range of `out` in q's dtype is written in place; else one copy of the rows afterwards
        dst = out[tok] if isinstance(tok, slice) and out.dtype == q.dtype else None
        o = dense_prefill(plan, q[tok], cache, block_table, tail_k, tail_v, fmt, scale, raw_varlen,
                          use_kernels=use_kernels, own_k=None if k is None else k[tok],
                          own_v=None if v is None else v[tok], out=dst)
        if dst is None:
            out[tok] = o.to(out.dtype)


def decode_step(plan: StepPlan, q, k, v, out, cache, block_table, seq_lens_dev, tail_slots_dev, tail_k, tail_v,
                fmt: KVFormat, scale: float, write_kv: bool = True, use_kernels: bool | None = None,
                raw_varlen: Callable | None = None) -> None:
    """A `decode_only` step: row b's one token is token b (q/k/v/out [N >= B, H, D]). On CUDA two store launches
    and the decode kernel, all reading seq_lens / block_table / tail slots on the device (no gathers, no host
    data: this is what a full CUDA graph captures); k / v are None (or write_kv False) for a layer sharing another
    layer's cache. Elsewhere the general store + attention path (same semantics)."""
    B = plan.num_reqs
    if use_kernels is None:
        use_kernels = q.is_cuda
    store_fn = _kernel("store", "store_decode", q.is_cuda) if use_kernels else None
    attn_fn = _kernel("decode", "decode_attention", q.is_cuda) if use_kernels else None
    if store_fn is None or attn_fn is None:
        if plan.defer is not False:
            raise RuntimeError("kvarn: a deferred-flush decode plan needs the decode kernels")
        if plan.minimal:
            raise RuntimeError("kvarn: a minimal decode plan needs the decode kernels (store_decode, decode_attention)")
        if write_kv and k is not None:
            store(plan, k, v, cache, tail_k, tail_v, fmt)
        attention(plan, q, k, v, out, cache, block_table, seq_lens_dev, tail_k, tail_v, fmt, scale,
                  raw_varlen=raw_varlen)
        return
    bt, sl, ts = block_table[:B], seq_lens_dev[:B], tail_slots_dev[:B]
    extra = {} if plan.defer is False else {"defer": plan.defer}  # (no bool() of a device flag: no sync)
    if write_kv and k is not None:
        store_fn(k[:B], v[:B], cache, bt, sl, tail_k, tail_v, ts, fmt, **extra)
    attn_fn(q[:B], cache, bt, sl, tail_k, tail_v, ts, fmt, scale, out=out[:B],
            sink_lens=None if plan.sink_lens is None else plan.sink_lens[:B],
            win_lens=None if plan.win_lens is None else plan.win_lens[:B], **extra)
