"""Attention of continuation chunks (chunked prefill, prefix-cache hits, spec-decode verify) over the quantized
prefix: the post-store K/V of those requests are materialized 16-bit (records dequantized, tail rows copied) and
FlashAttention varlen runs over them, trading a transient buffer (<= DENSE_KEY_BUDGET keys) for FlashAttention's
speed. Where FlashAttention is unavailable the torch varlen of kvarn.method.paged runs instead (same semantics).

Each chunk attends to its own new tokens raw and to the stored cache before them (the quantized prefix, the tail,
the sink), as kvarn.method.hf_cache does: the chunk's own keys are exact, as FlashAttention over a 16-bit cache
would see them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..formats import KVFormat
from ..method.paged import (
    PostStoreIndex,
    gather_post_store,
    post_store_index,
    post_store_kv,
    ragged_ranges,
    to_device,
    varlen_attention_torch,
)
from .common import kernel_lookup
from .step_plan import StepPlan

DENSE_KEY_BUDGET = 65536  # keys materialized at once (16-bit K + V: 256 MiB at Hk 8, D 128)


def _gather_kernels(use_kernels: bool, cuda: bool, prepared: bool = False) -> tuple[Callable | None, Callable | None]:
    """(kvarn.kernels.dequantize_to_rows, kvarn.kernels.rows.read_tail_rows), or with `prepared` their prepare_*
    forms, where asked for and Triton is installed, else (None, None): the reference decoder and torch indexing.
    cuda: the cache lives on a GPU, where a missing kernel is an error, not a fallback; a kernel module that fails
    to import for another reason (a broken Triton build) raises as it is."""
    if not use_kernels:
        return None, None
    names = ("prepare_dequantize", "prepare_read_tail_rows") if prepared else ("dequantize_to_rows", "read_tail_rows")
    found = kernel_lookup("dequant", names[0]), kernel_lookup("rows", names[1])
    missing = next((f for f in found if isinstance(f, ImportError)), None)
    if missing is not None:
        if cuda:
            raise RuntimeError(f"kvarn: a CUDA cache needs the Triton kernels, and they do not import here "
                               f"({missing}); install the triton that vLLM pins") from missing
        return None, None
    return found


def materialize_dense(rows: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray, cache, block_table, tail_k, tail_v,
                      fmt: KVFormat, dtype, use_kernels: bool | None = None, sink_lens=None, win_lens=None):
    """kvarn.method.paged.post_store_kv with the records decoded and the tail rows copied by the kernels (use_kernels
    None: where the cache is on CUDA; True: also in the interpreter; False: the reference decoder, torch indexing)."""
    decoder, read_rows = _gather_kernels(cache.is_cuda if use_kernels is None else use_kernels, cache.is_cuda)
    return post_store_kv(rows, seq_lens, slots, cache, block_table, tail_k, tail_v, fmt, dtype, sink_lens, decoder,
                         win_lens, read_rows)


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


def _step_gather(plan: StepPlan, group, prepare_dequantize: Callable, prepare_read_rows: Callable):
    """gather_post_store's (dequantize, read_rows) for one group of a step's continuation rows, through the step's
    prepared launches (StepPlan.launch): checked on the first layer, launched alone on the others."""

    def dequantize(cache, ids, dst, k, v, fmt):
        plan.launch(("dense records", group), lambda c, k_, v_: prepare_dequantize(c, ids, dst, k_, v_, fmt), cache,
                    k, v)

    def read_rows(tail_k, tail_v, slot, row, k, v, dst, use):
        plan.launch(("dense rows", group), lambda tk, tv, k_, v_: prepare_read_rows(tk, tv, slot, row, k_, v_, dst,
                                                                                     use), tail_k, tail_v, k, v)

    return dequantize, read_rows


def into(dst: torch.Tensor, o: torch.Tensor) -> None:
    """Rows a varlen call returned, into the output rows `dst` it was given as `out=`: nothing to do where it wrote
    them there (vLLM's FlashAttention), one copy where it returned them elsewhere (upstream flash-attn, the torch
    varlens)."""
    if o.data_ptr() != dst.data_ptr():
        dst.copy_(o)


@dataclass
class DenseGroup:
    """Continuation rows materialized at once (<= the key budget), with every index their attention needs; built
    once per step, on its first layer, and read by every layer."""
    index: PostStoreIndex
    q0: int  # their queries are qc[q0:q1] (qc: the continuation rows' queries, in row order)
    q1: int
    own_dst: torch.Tensor | slice  # the key rows of each row's own chunk (its last q_len positions): int64
    # [q1 - q0], or a slice for a group of one row (the usual chunked-prefill step: a copy, no scatter)
    cu_q: np.ndarray  # int64 [rows + 1], host
    cu_q_dev: torch.Tensor  # int32, for FlashAttention
    cu_k_dev: torch.Tensor
    max_q: int
    max_k: int


def dense_groups(plan: StepPlan, block_table, tail_rows: int, fmt: KVFormat, key_budget: int) -> list[DenseGroup]:
    """The continuation rows of a step in groups of at most `key_budget` keys (a longer row alone), indexed."""
    rows = plan.cont_rows
    dev = block_table.device
    s = plan.seq_lens[rows].astype(np.int64)
    qlen = (plan.qsl[rows + 1] - plan.qsl[rows]).astype(np.int64)
    q_cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(qlen, out=q_cu[1:])
    rows_dev = to_device(rows, np.int64, dev)

    def lens_of(lens, a, e):  # the group's rows of a device [R] tensor (a device gather: no sync)
        return None if lens is None else lens.to(dev)[rows_dev[a:e]]

    out = []
    for a, e in _groups(s, key_budget):
        ix = post_store_index(rows[a:e], s[a:e], plan.tail_slots_np[rows[a:e]], block_table, tail_rows, fmt,
                              lens_of(plan.sink_lens, a, e), lens_of(plan.win_lens, a, e))
        seg, pos = ragged_ranges(np.zeros(e - a, dtype=np.int64), qlen[a:e])
        cu_q = q_cu[a:e + 1] - q_cu[a]
        own = (slice(int(ix.cu_k[1] - qlen[a]), int(ix.cu_k[1])) if e - a == 1 else
               to_device(ix.cu_k[seg + 1] - qlen[a:e][seg] + pos, np.int64, dev))
        out.append(DenseGroup(ix, int(q_cu[a]), int(q_cu[e]), own, cu_q,
                              to_device(cu_q, np.int32, dev), to_device(ix.cu_k, np.int32, dev),
                              int(qlen[a:e].max()), int(s[a:e].max())))
    return out


def dense_prefill(plan: StepPlan, qc, cache, block_table, tail_k, tail_v, fmt: KVFormat, scale: float,
                  varlen: Callable | None = None, key_budget: int | None = None, use_kernels: bool | None = None,
                  own_k=None, own_v=None, out=None):
    """Attention of the continuation rows' queries qc [n, Hq, D] over their materialized post-store K/V, in groups
    of rows holding at most `key_budget` keys (bounds the transient 16-bit buffer): varlen(q, k, v, cu_q, max_q,
    cu_k=, max_k=, out=) (vLLM's FlashAttention) when given, else the torch varlen. Returns [n, Hq, D].
    own_k / own_v [n, Hk, D] (the chunks' new K/V, in qc's order): each chunk reads its own tokens raw. Without them
    every position reads the stored state (tiles the chunk completed come back quantized).
    out [n, Hq, D] (qc's dtype): written in place, group by group (FlashAttention's `out`), and returned.
    The groups and their indexes are built on the first call for a plan and kept on it (plan.prepared), and so are
    the kernels' launches: the step's other layers reuse them, with no host work or host->device copies of their
    own."""
    key_budget = DENSE_KEY_BUDGET if key_budget is None else key_budget
    key = ("dense", key_budget, tail_k.shape[2], fmt.name, str(cache.device))
    groups = plan.prepared.get(key)
    if groups is None:
        groups = plan.prepared[key] = dense_groups(plan, block_table, tail_k.shape[2], fmt, key_budget)
    kernels = _gather_kernels(cache.is_cuda if use_kernels is None else use_kernels, cache.is_cuda, prepared=True)
    outs = []
    for i, grp in enumerate(groups):
        gather = _step_gather(plan, (key, i), *kernels) if kernels[0] is not None else (None, None)
        k, v = gather_post_store(grp.index, cache, tail_k, tail_v, fmt, qc.dtype, *gather)
        if own_k is not None:  # row i's last q_len positions are its own chunk: raw
            k[grp.own_dst] = own_k[grp.q0:grp.q1].to(k.dtype)
            v[grp.own_dst] = own_v[grp.q0:grp.q1].to(v.dtype)
        q = qc[grp.q0:grp.q1]
        dst = None if out is None else out[grp.q0:grp.q1]
        if varlen is not None:
            o = varlen(q, k, v, grp.cu_q_dev, grp.max_q, cu_k=grp.cu_k_dev, max_k=grp.max_k, out=dst)
        else:
            o = varlen_attention_torch(q, k, v, grp.cu_q, grp.index.cu_k, scale)
        if dst is None:
            outs.append(o)
        else:
            into(dst, o)
    if out is not None:
        return out
    return outs[0] if len(outs) == 1 else torch.cat(outs)
