"""The 16-bit tail buffer of the vLLM backend: which tail slot each batch row uses, and the per-layer buffers.

A request's unfinished tile (fewer than g tokens) lives 16-bit in `tail_k / tail_v [S + 1, Hk, g + sink + 2W, D]` of
every KVarN layer, row `slot`, rows [g, g + sink) its first `sink` tokens for good (the attention sink), then the
window halves (a tile's last W positions, by tile parity). Row S is a
scratch row that dummy / padded batch rows point at, so they never touch a live request's tail. Slots come from one of two sources, set per step by the model-runner hooks (patches.py):

* Model Runner V2: the request's persistent index in `RequestState` (`input_batch.idx_mapping_np`): stable for the
  request's life, in [0, max_num_reqs), freed and reused by vLLM itself. Nothing to book-keep here.
* Model Runner V1: no stable index exists, so `SlotTable` assigns one per request id; the hook frees slots of
  finished and preempted requests (a preempted request is recomputed on resume, so its tail is rebuilt).

Nothing here imports vLLM (tested on CPU).
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from ..errors import KvarnError
from ..method.paged import host_tensor, to_device


class SlotTable:
    """Request id -> tail slot in [0, capacity), lowest free slot first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise KvarnError(f"tail slot capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slot: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives the lowest

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slot

    def release(self, req_ids) -> None:
        for rid in req_ids or ():
            s = self._slot.pop(rid, None)
            if s is not None:
                self._free.append(s)
        self._free.sort(reverse=True)

    def retain_only(self, live_ids) -> None:
        """Free every slot whose request is not in `live_ids` (belt and braces against missed frees)."""
        live = set(live_ids)
        self.release([r for r in self._slot if r not in live])

    def slot(self, req_id: str) -> int:
        s = self._slot.get(req_id)
        if s is None:
            if not self._free:
                raise KvarnError(
                    f"kvarn: all {self.capacity} tail slots are in use; the scheduler ran more requests at once than "
                    "max_num_seqs (the tail buffer is sized for max_num_seqs)"
                )
            s = self._free.pop()
            self._slot[req_id] = s
        return s

    def rows(self, req_ids) -> np.ndarray:
        return np.fromiter((self.slot(r) for r in req_ids), dtype=np.int32, count=len(req_ids))


class StepSlots:
    """The row -> tail slot map of the step being built (one per process: one model runner per process)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.rows: np.ndarray | None = None  # int32 [num_reqs] for the current step; None: dummy step
        self.table: SlotTable | None = None  # MRv1 only
        self.source = "none"
        # the step schedules a new or resumed request (a prefix hit may read a block another row completes in
        # this very step): such a step must not defer its flush. True unless a runner hook says otherwise.
        self.fresh = True

    def set_rows(self, rows, source: str, fresh: bool = True) -> None:
        with self._lock:
            self.rows = None if rows is None else np.asarray(rows, dtype=np.int32)
            self.source = source
            self.fresh = fresh

    def set_dummy(self) -> None:
        self.set_rows(None, "dummy")

    def rows_for(self, num_reqs: int, scratch: int) -> np.ndarray:
        """Slots for `num_reqs` batch rows; rows without a request (padding, dummy runs) get the scratch slot."""
        out = np.full(num_reqs, scratch, dtype=np.int32)
        r = self.rows
        if r is not None:
            n = min(num_reqs, len(r))
            out[:n] = r[:n]
        return out


STEP = StepSlots()


class TailBuffers:
    """Per-layer 16-bit tail tensors, allocated once per layer name (builders may be created more than once)."""

    def __init__(self):
        self._bufs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tags: dict[tuple, torch.Tensor] = {}
        self._caches: dict[str, torch.Tensor] = {}  # layer -> its paged cache (register_cache)
        self._pending: dict[tuple, PendingFlush] = {}
        self.slots = 0  # S (without the scratch row)

    def allocate(self, layer_names, slots: int, num_kv_heads: int, group: int, head_dim: int,
                 dtype: torch.dtype, device, sink: int = 0, window: int = 0) -> None:
        for name in layer_names:
            if name in self._bufs:
                continue
            # rows [group, group + sink): the sink; then the two window halves
            shape = (slots + 1, num_kv_heads, group + sink + 2 * window, head_dim)
            self._bufs[name] = (torch.zeros(shape, dtype=dtype, device=device),
                                torch.zeros(shape, dtype=dtype, device=device))
        self.slots = max(self.slots, slots)

    def sink_tags(self, layer_names, slots: int, device) -> torch.Tensor:
        """The sink ownership tags (step_plan.update_sink_lens) of the slots these layers' buffers hold: one int32 [S + 1]
        per layer set, shared by every metadata builder of those layers (their claims must see each other)."""
        key = tuple(sorted(layer_names))
        t = self._tags.get(key)
        if t is None or t.shape[0] < slots + 1:
            t = self._tags[key] = torch.full((slots + 1,), -1, dtype=torch.int32, device=device)
        return t

    def window_tags(self, layer_names, slots: int, device) -> torch.Tensor:
        """The window tags (step_plan.update_window_lens) of the slots these layers' buffers hold: one int32
        [S + 1, 2] per layer set, shared by every metadata builder of those layers."""
        key = ("window", *sorted(layer_names))
        t = self._tags.get(key)
        if t is None or t.shape[0] < slots + 1:
            t = self._tags[key] = torch.full((slots + 1, 2), -1, dtype=torch.int32, device=device)
        return t

    def get(self, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._bufs[layer_name]
        except KeyError:
            raise KvarnError(f"kvarn: no tail buffer for layer {layer_name!r} (the metadata builder did not run)") from None

    def __contains__(self, name: str) -> bool:
        return name in self._bufs

    def pending(self, layer_names, capacity: int, device) -> "PendingFlush":
        """The deferred-flush state of these layers, shared by every metadata builder of them (the builder of the
        next step flushes what the last one left pending)."""
        key = tuple(sorted(layer_names))
        pf = self._pending.get(key)
        if pf is None:
            pf = self._pending[key] = PendingFlush(capacity, device)
        pf.grow(capacity)
        return pf

    def register_cache(self, layer_name: str, cache: torch.Tensor | None) -> None:
        """The layer's paged cache, as its forward sees it (the deferred flush reaches every layer from one launch);
        None for a layer that shares another's cache (its records are the other's)."""
        self._caches[layer_name] = cache

    def layer_buffers(self, layer_names):
        """(tails_k, tails_v, caches) of these layers' own caches, or None if one of them never ran its forward
        (then nothing can be flushed for it: the caller must not lose tiles silently)."""
        if any(n not in self._caches for n in layer_names):
            return None
        names = [n for n in layer_names if self._caches[n] is not None]
        return [self._bufs[n][0] for n in names], [self._bufs[n][1] for n in names], [self._caches[n] for n in names]

    def clear(self) -> None:
        self._bufs.clear()
        self._tags.clear()
        self._caches.clear()
        self._pending.clear()
        self.slots = 0


_LOG = logging.getLogger("vllm.kvarn")
SLOW_LAUNCH_S = 0.1  # a deferred flush whose launch takes longer is logged (a stall then has a line to match)


class PendingFlush:
    """Tiles that deferred decode steps completed and left in the 16-bit tail (ops.decode_step with plan.defer:
    the step's attention reads them there). The next step's metadata build quantizes them, every layer in one
    kernels.store.flush_layers launch, enqueued before that step's forward (same stream), so the tail rows are read
    before a new token overwrites row 0. A request that finished or was preempted in between is flushed too: its
    blocks may stay in the prefix cache. Host row indexes, device slots / block ids."""

    def __init__(self, capacity: int, device):
        self.slots = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.blocks = torch.full((capacity,), -1, dtype=torch.int32, device=device)
        self.n = 0
        # the step's deferral flag on the device (a captured decode graph reads it: shared by every builder of the
        # layer set, like the pending tiles) and its host mirror
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._flag_now = 0
        self.flushes = 0

    def set_flag(self, value: int) -> torch.Tensor:
        """This step's deferral (1) or not (0), written to the device flag only when it changes."""
        if value != self._flag_now:
            self.flag.fill_(value)
            self._flag_now = value
        return self.flag

    def grow(self, capacity: int) -> None:
        """Room for `capacity` tiles, in place (every builder of the layer set holds this object)."""
        if capacity > self.slots.shape[0]:
            slots = torch.zeros(capacity, dtype=torch.int32, device=self.slots.device)
            blocks = torch.full((capacity,), -1, dtype=torch.int32, device=self.slots.device)
            slots[:self.n], blocks[:self.n] = self.slots[:self.n], self.blocks[:self.n]
            self.slots, self.blocks = slots, blocks

    def note(self, seq_lens: np.ndarray, rows: np.ndarray, block_table: torch.Tensor, group: int,
             scratch: int | None = None) -> None:
        """After building a deferred decode step: the rows whose token completes a tile (exact host seq_lens; rows
        on the scratch slot are padding / dummy runs). No host sync: the index copies come from pinned memory, the
        block ids a device gather."""
        seq = np.asarray(seq_lens, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int32)
        keep = (seq > 0) & (seq % group == 0)
        if scratch is not None:
            keep &= rows != scratch
        done = np.nonzero(keep)[0]
        n = len(done)
        if n > self.slots.shape[0]:
            raise KvarnError(f"kvarn: {n} tiles to flush, the pending buffer holds {self.slots.shape[0]}")
        self.n = n
        if n == 0:
            return
        dev = self.slots.device
        self.blocks[:n] = block_table[to_device(done, np.int64, dev), to_device(seq[done] // group - 1, np.int64,
                                                                                 dev)].to(torch.int32)
        self.slots[:n].copy_(host_tensor(rows[done], np.int32, dev), non_blocking=True)

    def flush(self, buffers, fmt) -> int:
        """Quantize the pending tiles into every layer's cache; returns how many tiles (0: nothing pending)."""
        n, self.n = self.n, 0
        if n == 0:
            return 0
        if buffers is None:
            raise KvarnError("kvarn: tiles are pending a flush but a layer's cache was never seen by its forward")
        from ..kernels.store import flush_layers

        t0 = time.perf_counter()
        flush_layers(*buffers, self.slots[:n], self.blocks[:n], fmt)
        host_s = time.perf_counter() - t0  # a launch is microseconds; seconds mean a compile (or a wait) in it
        self.flushes += 1
        if self.flushes == 1 or host_s > SLOW_LAUNCH_S:
            _LOG.info("kvarn: deferred flush #%d: %d tiles, launch %.3f s on the host%s", self.flushes, n, host_s,
                      " (slow: a compile?)" if host_s > SLOW_LAUNCH_S else "")
        return n


TAILS = TailBuffers()


def tail_bytes(slots: int, num_kv_heads: int, group: int, head_dim: int, itemsize: int, sink: int = 0,
               window: int = 0) -> int:
    """Bytes of one layer's K and V tails (unfinished tile + sink + window halves), scratch row included."""
    return 2 * (slots + 1) * num_kv_heads * (group + sink + 2 * window) * head_dim * itemsize
