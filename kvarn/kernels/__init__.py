"""Triton kernels for the KVarN paged cache (docs/format.md), by role:

    store      quantize-on-write: store_tiles, store_step_tiles, store_decode, flush_layers
    decode     decode_attention: split-K attention of one query token per request over records + tail
    tail       the tail's attention (run inside the decode launch) and the merge of the split partials
    dequant    dequantize_to_rows: records -> 16-bit K / V rows, for the dense prefill path
    rows       write_tail_rows / read_tail_rows: a step's 16-bit row copies between its K / V and the tail
    tags       decode_tags: a decode-only step's sink and window bookkeeping in one launch
    device     Triton device functions shared by the kernels (Hadamard rotation, split bookkeeping)
    records    host-side record layout and argument checks
    runtime    the serving jit, interpreter / hardware checks, the compile log

The kernels a step launches in every layer also come as prepare_* functions in their modules (store.
prepare_step_tiles, rows.prepare_write_tail_rows / prepare_read_tail_rows, decode.prepare_decode, dequant.
prepare_dequantize): the checks and the arguments built once, returning a launch that takes only the tensors that
change from layer to layer (kvarn.vllm_plugin.step_plan.StepPlan.launch keeps them for the step).

Imported lazily so that `import kvarn` never needs triton.
"""
from __future__ import annotations

__all__ = ["store_tiles", "store_step_tiles", "store_decode", "flush_layers", "dequantize_to_rows", "decode_attention"]


def __getattr__(name):
    if name in ("store_tiles", "store_step_tiles", "store_decode", "flush_layers"):
        from . import store

        return getattr(store, name)
    if name == "decode_attention":
        from .decode import decode_attention

        return decode_attention
    if name == "dequantize_to_rows":
        from .dequant import dequantize_to_rows

        return dequantize_to_rows
    raise AttributeError(name)
