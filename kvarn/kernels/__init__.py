"""Triton kernels for the KVarN paged cache (docs/format.md).

    store_tiles(k, v, cache, block_ids, fmt, iters=None)                 quantize-on-write (kvarn.kernels.store)
    store_tail_tokens(k, v, tail_k, tail_v, tail_slot, tail_pos)         16-bit tail scatter
    store_decode(k, v, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, fmt)
                                                                         a decode step's KV write (tail + flush)
    decode_attention(q, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, fmt, scale,
                     num_splits=None, out=None)                          fused split-K decode (kvarn.kernels.decode)
    prefill_attention(q, cache, block_table, query_start_loc, seq_lens, tail_k, tail_v, tail_slots, fmt, scale,
                      max_query_len, out=None)                           causal varlen over the cache (kvarn.kernels.prefill)
    dequantize_to_rows(cache, block_ids, dst_rows, k_out, v_out, fmt)  records -> 16-bit K/V rows (kvarn.kernels.dequant)
    prepare(head_dim, device)                                            warm per-device constants before graph capture

Imported lazily so `import kvarn` never needs triton.
"""
from __future__ import annotations

__all__ = ["store_tiles", "store_tail_tokens", "store_decode", "dequantize_to_rows", "decode_attention", "prefill_attention", "prepare"]


def __getattr__(name):
    if name in ("store_tiles", "store_tail_tokens", "store_decode"):
        from . import store

        return getattr(store, name)
    if name == "decode_attention":
        from .decode import decode_attention

        return decode_attention
    if name == "prefill_attention":
        from .prefill import prefill_attention

        return prefill_attention
    if name == "dequantize_to_rows":
        from .dequant import dequantize_to_rows

        return dequantize_to_rows
    if name == "prepare":
        from .common import prepare

        return prepare
    raise AttributeError(name)
