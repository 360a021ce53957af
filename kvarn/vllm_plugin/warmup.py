"""Engine-start warm-up: compile every kernel variant a serving step can launch before the first request arrives.

vLLM's own warm-up (profile run, CUDA-graph capture) runs only decode-only steps through this backend, so the
kernels that prefill steps launch (the tile store of a prompt, the record decoder of a continuation chunk, the
eager decode of a mixed batch) would compile at their first use, under load: seconds each, a stall of every
running request. Here a few synthetic steps on scratch tensors run the same ops paths instead; the scratch shapes
differ from the real ones only in the sizes that the kernels do not specialise on (kvarn.kernels.runtime.
serving_jit), so the compiled variants are the ones real steps use.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from .. import settings
from ..formats import KVFormat
from ..kernels.runtime import kernel_compile_cache
from ..method.paged import raw_attention_torch, varlen_attention_torch
from . import ops
from .step_plan import plan_step, update_lens

_LOG = logging.getLogger("vllm.kvarn")
_DONE: set = set()


def _torch_varlen(scale: float):
    """The FlashAttention varlen signature ops expects (raw_varlen), in torch: the warm-up needs no FA (compiled
    ahead of time), only the dense path's routing, which takes a varlen function."""

    def run(q, k, v, cu, max_len, cu_k=None, max_k=None, out=None):  # new rows, never `out` (ops copies them in)
        if cu_k is None:
            return raw_attention_torch(q, k, v, cu.cpu(), scale)
        return varlen_attention_torch(q, k, v, cu.cpu().numpy(), cu_k.cpu().numpy(), scale)

    return run


def synthetic_steps(num_kv_heads: int, num_heads: int, head_size: int, dtype: torch.dtype, fmt: KVFormat,
                    device, *, defer: bool = False) -> list:
    """Steps of two requests through ops, as the backend's forward runs them: (1) two fresh prompts that complete
    a tile each and leave tokens in the tail (store_step_tiles, raw attention); (2) a mixed step, one decode row
    (decode_attention, eagerly) and one continuation chunk over a stored tile (the record decoder + varlen
    attention); (3) a decode-only step run eagerly (store_decode + decode_attention: batches above
    the largest captured size, --enforce-eager), with `defer` (on a GPU) as the backend then runs every decode-only
    step: with a deferral flag (of 0), so only the DEFER variants compile (a store variant is ~12 s of engine start
    on an H200, and the backend never launches the other one then). Returns the plans."""
    g, sink = fmt.group, fmt.sink_tokens
    H, Hq, D = num_kv_heads, num_heads, head_size
    on_gpu = torch.device(device).type == "cuda"
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    nb = 4  # blocks per request
    cache = torch.zeros(2 * nb + 1, H, fmt.record_bytes(D), dtype=torch.uint8, device=device)
    tail_k = torch.zeros(3, H, fmt.tail_rows, D, dtype=dtype, device=device)  # slots 0, 1 and the padding row
    tail_v = torch.zeros_like(tail_k)
    bt = (1 + torch.arange(2 * nb, dtype=torch.int32, device=device)).view(2, nb)
    slots = np.array([0, 1], dtype=np.int32)
    tags = torch.full((3,), -1, dtype=torch.int32, device=device)
    sink_lens = torch.zeros(3, dtype=torch.int32, device=device)
    win_tags = torch.full((3, 2), -1, dtype=torch.int32, device=device)
    win_lens = torch.zeros(3, dtype=torch.int32, device=device)
    scale = D ** -0.5
    varlen = _torch_varlen(scale)
    plans, lens = [], np.zeros(2, dtype=np.int64)
    for qlen in ([g + 3, g + 2], [1, 5]):
        qsl = np.concatenate([[0], np.cumsum(qlen)])
        seq = lens + np.asarray(qlen)
        plan = plan_step(qsl, seq, 2, slots, bt, g, device, sink=sink, window=fmt.window_tokens)
        update_lens(plan, tags, win_tags, bt, sink_lens, win_lens)
        n = int(qsl[-1])
        q, k, v = rnd(n, Hq, D), rnd(n, H, D), rnd(n, H, D)
        ops.store(plan, k, v, cache, tail_k, tail_v, fmt)
        seq_dev = torch.from_numpy(seq.astype(np.int32)).to(device)
        ops.attention(plan, q, k, v, torch.empty_like(q), cache, bt, seq_dev, tail_k, tail_v, fmt, scale,
                      raw_varlen=varlen)
        plans.append(plan)
        lens = seq
    slots_dev = torch.from_numpy(slots).to(device)
    for flag in [torch.zeros(1, dtype=torch.int32, device=device)] if defer and on_gpu else [False]:
        lens = lens + 1
        seq_dev = torch.from_numpy(lens.astype(np.int32)).to(device)
        plan = plan_step(np.arange(3), lens, 2, slots, bt, g, device, decode_minimal=on_gpu,
                              tail_slots_dev=slots_dev, sink=sink, window=fmt.window_tokens)
        plan.defer = flag  # a device flag of 0: the DEFER kernels, flushing at once as without deferral
        update_lens(plan, tags, win_tags, bt, sink_lens, win_lens, seq_lens_dev=seq_dev if on_gpu else None)
        q, k, v = rnd(2, Hq, D), rnd(2, H, D), rnd(2, H, D)
        ops.decode_step(plan, q, k, v, torch.empty_like(q), cache, bt, seq_dev, slots_dev, tail_k, tail_v, fmt,
                        scale, raw_varlen=varlen)
        plans.append(plan)
    return plans


def warm_up(num_kv_heads: int, num_heads: int, head_size: int, dtype: torch.dtype, fmt: KVFormat, device, *,
            defer: bool = False) -> float:
    """Once per process and shape: the synthetic steps, and with the deferred flush its one-launch kernel, compiled
    into the Triton cache of kernel_compile_cache. Syncs: call it before graph capture (the metadata builder's
    __init__). A failure is logged, not raised (the kernels then compile at first use). Returns the seconds it took
    (0.0 when already done, failed or not on CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    steps_key = (num_kv_heads, num_heads, head_size, dtype, fmt.name, device, defer)
    flush_key = ("flush", num_kv_heads, head_size, dtype, fmt.name, device)
    todo = [k for k in (steps_key, flush_key if defer else None) if k is not None and k not in _DONE]
    if not todo:
        return 0.0
    t0 = time.perf_counter()
    try:
        with kernel_compile_cache():  # one cache for every engine configuration: a later start loads, not compiles
            if steps_key in todo:
                synthetic_steps(num_kv_heads, num_heads, head_size, dtype, fmt, device, defer=defer)
            if flush_key in todo:  # its first flush would otherwise compile mid-run
                from ..kernels.store import compile_flush_layers

                compile_flush_layers(num_kv_heads, head_size, fmt.tail_rows, dtype, fmt, device)
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - a warm-up must not stop the engine: kernels compile at first use
        _LOG.warning("kvarn: kernel warm-up failed (%s: %s); kernels will compile at first use, mid-run",
                     type(e).__name__, e)
        return 0.0
    _DONE.update(todo)
    secs = time.perf_counter() - t0
    # the settings in the log too: what a run used is then readable from its log alone (rows carry them as well)
    _LOG.info("kvarn: kernels warmed up for %d/%d heads, head_dim %d, %s in %.1f s (deferred flush %s; %s)",
              num_heads, num_kv_heads, head_size, str(dtype).replace("torch.", ""), secs, "on" if defer else "off",
              settings.result_env(speed=True))
    return secs
