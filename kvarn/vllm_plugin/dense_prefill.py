"""Attention of continuation chunks (chunked prefill, prefix-cache hits, spec-decode verify) over the quantized
prefix: the post-store K/V of those requests are materialized 16-bit (records dequantized, tail rows copied) and
FlashAttention varlen runs over them, trading a transient buffer (<= DENSE_KEY_BUDGET keys) for FlashAttention's
speed. Where FlashAttention is unavailable the torch varlen of kvarn.method.paged runs instead (same semantics).

Each chunk attends to its own new tokens raw and to the stored cache before them (the quantized prefix, the tail,
the sink), as kvarn.method.hf_cache does: the chunk's own keys are exact, as FlashAttention over a 16-bit cache
would see them.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..formats import KVFormat
from ..method.paged import post_store_kv, ragged_ranges, varlen_attention_torch
from .step_plan import StepPlan

DENSE_KEY_BUDGET = 65536  # keys materialized at once (16-bit K + V: 256 MiB at Hk 8, D 128)


def _record_decoder(use_kernels: bool, cuda: bool) -> Callable | None:
    """kvarn.kernels.dequantize_to_rows where asked for and Triton is installed, else None (the reference decoder).
    cuda: the cache lives on a GPU, where a missing kernel is an error, not a fallback; a kernel module that fails to
    import for another reason (a broken Triton build) raises as it is."""
    if not use_kernels:
        return None
    try:
        from ..kernels.dequant import dequantize_to_rows
    except ImportError as e:
        if cuda:
            raise RuntimeError(f"kvarn: a CUDA cache needs the Triton kernels, and kvarn.kernels.dequant does not "
                               f"import here ({e}); install the triton that vLLM pins") from e
        return None
    return dequantize_to_rows


def materialize_dense(rows: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray, cache, block_table, tail_k, tail_v,
                      fmt: KVFormat, dtype, use_kernels: bool | None = None, sink_lens=None, win_lens=None):
    """kvarn.method.paged.post_store_kv with the records decoded by the kernel (use_kernels None: where the cache is
    on CUDA; True: also in the interpreter; False: the reference decoder)."""
    decoder = _record_decoder(cache.is_cuda if use_kernels is None else use_kernels, cache.is_cuda)
    return post_store_kv(rows, seq_lens, slots, cache, block_table, tail_k, tail_v, fmt, dtype, sink_lens, decoder,
                         win_lens)


def _groups(lens: np.ndarray, budget: int):
    """Consecutive index ranges [a, e) whose lens sum to <= budget (a single longer one stands alone)."""
    a, tot = 0, 0
    for i, n in enumerate(lens):
        if i > a and tot + n > budget:
            yield a, i
            a, tot = i, 0
        tot += int(n)
    if a < len(lens):
        yield a, len(lens)


def dense_prefill(plan: StepPlan, qc, cache, block_table, tail_k, tail_v, fmt: KVFormat, scale: float,
                  varlen: Callable | None = None, key_budget: int | None = None, use_kernels: bool | None = None,
                  own_k=None, own_v=None):
    """Attention of the continuation rows' queries qc [n, Hq, D] over their materialized post-store K/V, in groups
    of rows holding at most `key_budget` keys (bounds the transient 16-bit buffer): varlen(q, k, v, cu_q, max_q,
    cu_k=, max_k=) (vLLM's FlashAttention) when given, else the torch varlen. Returns [n, Hq, D].
    own_k / own_v [n, Hk, D] (the chunks' new K/V, in qc's order): each chunk reads its own tokens raw. Without them
    every position reads the stored state (tiles the chunk completed come back quantized)."""
    rows = plan.cont_rows
    key_budget = DENSE_KEY_BUDGET if key_budget is None else key_budget
    s = plan.seq_lens[rows].astype(np.int64)
    qlen = (plan.qsl[rows + 1] - plan.qsl[rows]).astype(np.int64)
    q_cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(qlen, out=q_cu[1:])
    outs = []
    for a, e in _groups(s, key_budget):
        k, v, cu_k = materialize_dense(rows[a:e], s[a:e], plan.tail_slots_np[rows[a:e]], cache, block_table,
                                       tail_k, tail_v, fmt, qc.dtype, use_kernels,
                                       None if plan.sink_lens is None else plan.sink_lens[rows[a:e]],
                                       None if plan.win_lens is None else plan.win_lens[rows[a:e]])
        if own_k is not None:  # row i's last qlen[i] positions are its own chunk: raw
            seg, pos = ragged_ranges(np.zeros(e - a, dtype=np.int64), qlen[a:e])
            dst = torch.from_numpy(cu_k[seg + 1] - qlen[a:e][seg] + pos).to(k.device)
            k[dst] = own_k[int(q_cu[a]):int(q_cu[e])].to(k.dtype)
            v[dst] = own_v[int(q_cu[a]):int(q_cu[e])].to(v.dtype)
        q = qc[int(q_cu[a]):int(q_cu[e])]
        cu_q = q_cu[a:e + 1] - q_cu[a]
        if varlen is not None:
            to_dev = lambda x: torch.from_numpy(x.astype(np.int32)).to(qc.device, non_blocking=True)  # noqa: E731
            outs.append(varlen(q, k, v, to_dev(cu_q), int(qlen[a:e].max()), cu_k=to_dev(cu_k),
                               max_k=int(s[a:e].max())))
        else:
            outs.append(varlen_attention_torch(q, k, v, cu_q, cu_k, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
