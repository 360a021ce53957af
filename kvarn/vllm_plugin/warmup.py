"""Engine-start warm-up: compile every kernel variant a serving step can launch before the first request arrives.

vLLM's own warm-up (profile run, CUDA-graph capture) runs only decode-only steps through this backend, so the
kernels that prefill steps launch (the tile store of a prompt, the record decoder of a continuation chunk, the
eager decode of a mixed batch) used to compile at their first use, mid-run: on the H200 (session 12) two store
variants of 4.8-6.3 s and the record decoder's 1.2 s in every KVarN run, a stall of every running request (the
showcase's TTFT, `vllm serve`'s 5 s first-token latency). Here a few synthetic steps on scratch tensors run the
same ops paths instead; the scratch shapes differ from the real ones only in the sizes that the kernels do not
specialise on (kvarn.kernels.common.serving_jit), so the compiled variants are the ones real steps use.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..formats import KVFormat
from . import ops

_LOG = logging.getLogger("vllm.kvarn")
_DONE: set = set()


def _torch_varlen(scale: float):
    """The FlashAttention varlen signature ops expects (raw_varlen), in torch: the warm-up needs no FA (compiled
    ahead of time), only the dense path's routing, which takes a varlen function."""

    def run(q, k, v, cu, max_len, cu_k=None, max_k=None):
        if cu_k is None:
            return ops.raw_attention_torch(q, k, v, cu.cpu(), scale)
        return ops.dense_varlen_torch(q, k, v, cu.cpu().numpy(), cu_k.cpu().numpy(), scale)

    return run


def synthetic_steps(num_kv_heads: int, num_heads: int, head_size: int, dtype: torch.dtype, fmt: KVFormat,
                    device) -> list:
    """Three steps of two requests through ops, as the backend's forward runs them: (1) two fresh prompts that
    complete a tile each and leave tokens in the tail (store_tiles, raw attention); (2) a mixed step, one decode
    row (decode_attention, eagerly) and one continuation chunk over a stored tile (the prefill path of
    KVARN_PREFILL: the record decoder + varlen attention, or the fused prefill kernel); (3) a decode-only step
    run eagerly (store_decode + decode_attention: batches above the largest captured size, --enforce-eager).
    Returns the three plans (tests check what they cover)."""
    g, sink = fmt.group, fmt.sink_tokens
    H, Hq, D = num_kv_heads, num_heads, head_size
    on_gpu = torch.device(device).type == "cuda"
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    cache = torch.zeros(8, H, fmt.record_bytes(D), dtype=torch.uint8, device=device)
    tail_k = torch.zeros(3, H, g + sink, D, dtype=dtype, device=device)  # slots 0, 1 and the padding row
    tail_v = torch.zeros_like(tail_k)
    bt = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device=device)
    slots = np.array([0, 1], dtype=np.int32)
    tags = torch.full((3,), -1, dtype=torch.int32, device=device)
    sink_lens = torch.zeros(3, dtype=torch.int32, device=device)
    scale = D ** -0.5
    varlen = _torch_varlen(scale)
    plans, lens = [], np.zeros(2, dtype=np.int64)
    for qlen in ([g + 3, g + 2], [1, 5]):
        qsl = np.concatenate([[0], np.cumsum(qlen)])
        seq = lens + np.asarray(qlen)
        plan = ops.build_plan(qsl, seq, 2, slots, bt, g, device, sink=sink)
        ops.update_sink_lens(plan, tags, bt, sink_lens)
        n = int(qsl[-1])
        q, k, v = rnd(n, Hq, D), rnd(n, H, D), rnd(n, H, D)
        ops.store(plan, k, v, cache, tail_k, tail_v, fmt)
        seq_dev = torch.from_numpy(seq.astype(np.int32)).to(device)
        ops.attention(plan, q, k, v, torch.empty_like(q), cache, bt, seq_dev, tail_k, tail_v, fmt, scale,
                      raw_varlen=varlen)
        plans.append(plan)
        lens = seq
    seq = lens + 1
    seq_dev = torch.from_numpy(seq.astype(np.int32)).to(device)
    slots_dev = torch.from_numpy(slots).to(device)
    plan = ops.build_plan(np.arange(3), seq, 2, slots, bt, g, device, decode_minimal=on_gpu,
                          tail_slots_dev=slots_dev, sink=sink)
    ops.update_sink_lens(plan, tags, bt, sink_lens)
    q, k, v = rnd(2, Hq, D), rnd(2, H, D), rnd(2, H, D)
    ops.decode_step(plan, q, k, v, torch.empty_like(q), cache, bt, seq_dev, slots_dev, tail_k, tail_v, fmt, scale,
                    raw_varlen=varlen)
    plans.append(plan)
    return plans


def warm_up(num_kv_heads: int, num_heads: int, head_size: int, dtype: torch.dtype, fmt: KVFormat, device, *,
            defer: bool = False) -> float:
    """Once per process and shape: the kernels' device checks (kernels.prepare), the synthetic steps, and with the
    deferred flush its one-launch kernel. Syncs: call it before graph capture (the metadata builder's __init__).
    Returns the seconds it took (0.0 when already done or not on CUDA)."""
    device = torch.device(device)
    key = (num_kv_heads, num_heads, head_size, dtype, fmt.name, device, defer)
    if device.type != "cuda" or key in _DONE:
        return 0.0
    from ..kernels import prepare

    t0 = time.perf_counter()
    prepare(head_size, device)
    synthetic_steps(num_kv_heads, num_heads, head_size, dtype, fmt, device)
    if defer:  # its first flush would otherwise compile mid-run (BENCHMARKS.md, session 10)
        from ..kernels.store import compile_flush_layers

        compile_flush_layers(num_kv_heads, head_size, fmt.group + fmt.sink_tokens, dtype, fmt, device)
    torch.cuda.synchronize(device)
    _DONE.add(key)
    secs = time.perf_counter() - t0
    _LOG.info("kvarn: kernels warmed up for %d/%d heads, head_dim %d, %s in %.1f s", num_heads, num_kv_heads,
              head_size, str(dtype).replace("torch.", ""), secs)
    return secs
