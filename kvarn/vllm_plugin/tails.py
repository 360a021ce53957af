"""The 16-bit tail buffer of the vLLM backend: which tail slot each batch row uses, and the per-layer buffers.

A request's unfinished tile (fewer than g tokens) lives 16-bit in `tail_k / tail_v [S + 1, Hk, g + sink, D]` of
every KVarN layer, row `slot`, rows [g, g + sink) its first `sink` tokens for good (the attention sink). Row S is a
scratch row that dummy / padded batch rows point at, so they never touch a live request's tail. Slots come from one of two sources, set per step by the model-runner hooks (patches.py):

* Model Runner V2: the request's persistent index in `RequestState` (`input_batch.idx_mapping_np`): stable for the
  request's life, in [0, max_num_reqs), freed and reused by vLLM itself. Nothing to book-keep here.
* Model Runner V1: no stable index exists, so `SlotTable` assigns one per request id; the hook frees slots of
  finished and preempted requests (a preempted request is recomputed on resume, so its tail is rebuilt).

Nothing here imports vLLM (tested on CPU).
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from ..errors import KvarnError


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

    def set_rows(self, rows, source: str) -> None:
        with self._lock:
            self.rows = None if rows is None else np.asarray(rows, dtype=np.int32)
            self.source = source

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
        self.slots = 0  # S (without the scratch row)

    def allocate(self, layer_names, slots: int, num_kv_heads: int, group: int, head_dim: int,
                 dtype: torch.dtype, device, sink: int = 0) -> None:
        for name in layer_names:
            if name in self._bufs:
                continue
            shape = (slots + 1, num_kv_heads, group + sink, head_dim)  # rows [group, group + sink): the sink
            self._bufs[name] = (torch.zeros(shape, dtype=dtype, device=device),
                                torch.zeros(shape, dtype=dtype, device=device))
        self.slots = max(self.slots, slots)

    def sink_tags(self, layer_names, slots: int, device) -> torch.Tensor:
        """The sink ownership tags (ops.update_sink_lens) of the slots these layers' buffers hold: one int32 [S + 1]
        per layer set, shared by every metadata builder of those layers (their claims must see each other)."""
        key = tuple(sorted(layer_names))
        t = self._tags.get(key)
        if t is None or t.shape[0] < slots + 1:
            t = self._tags[key] = torch.full((slots + 1,), -1, dtype=torch.int32, device=device)
        return t

    def get(self, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._bufs[layer_name]
        except KeyError:
            raise KvarnError(f"kvarn: no tail buffer for layer {layer_name!r} (the metadata builder did not run)") from None

    def __contains__(self, name: str) -> bool:
        return name in self._bufs

    def clear(self) -> None:
        self._bufs.clear()
        self._tags.clear()
        self.slots = 0


TAILS = TailBuffers()


def tail_bytes(slots: int, num_kv_heads: int, group: int, head_dim: int, itemsize: int, sink: int = 0) -> int:
    """Bytes of one layer's K and V tails (unfinished tile + sink), scratch row included."""
    return 2 * (slots + 1) * num_kv_heads * (group + sink) * head_dim * itemsize
