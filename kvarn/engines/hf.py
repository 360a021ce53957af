"""What bench's and eval's transformers engines share: the KV cache of a KV format, one per request or batch (FP16 in
transformers' DynamicCache, every other format stored through kvarn.method.hf_cache.KVCodecCache, real packed bytes),
and the forward kwargs of a prefill that only needs its last position's logits."""
from __future__ import annotations

from ..formats import get_format


def kv_cache(kv_dtype: str, model):
    """A fresh cache for `model` holding K/V as `kv_dtype` stores them. Each stored unit is decoded once and its copy
    kept (decoding is deterministic: identical numbers), a CPU stand-in for an attention kernel that reads packed
    units, instead of decoding every unit again at every step; memory_bytes() reports the copies apart."""
    fmt = get_format(kv_dtype)
    if fmt.family == "fp16":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from ..method.hf_cache import KVCodecCache

    return KVCodecCache(fmt.name, config=model.config, keep_decoded=True)


def last_logits_only(model) -> dict:
    """Forward kwargs that compute a prefill's logits at its last position only (the one the next token needs): the
    LM head over a whole prompt is a fifth of a small model's prefill time on a CPU."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
