"""The accuracy axis of a bench row: chunked perplexity of a short Moby-Dick window through the row's KV format.

The window goes through the model in chunks of `chunk` tokens, each chunk attending to the earlier ones as the
format stored them (kvarn.method.hf_cache.KVCodecCache: stored tiles quantized, the unfinished tile and the format's
sink 16-bit), the chunking `kvarn fidelity` uses. The fp16 reference is the identity cache; the engine computes it
once per model, so each row carries it and its change against it. Only rows with real weights get one.
"""
from __future__ import annotations

import math

PPL_TOKENS = 512  # four 128-token tiles: KVarN's stored tiles, not its 16-bit tail, decide the result
PPL_CHUNK = 128


def window_ids(tokenizer, tokens: int = PPL_TOKENS):
    """The first `tokens` tokens of the shipped Moby-Dick excerpt after its title pages, as [1, tokens]."""
    from ..method.fidelity import MOBY_START
    from ..method.textdata import load_text

    ids = tokenizer(load_text()[MOBY_START:MOBY_START + 8 * tokens], return_tensors="pt").input_ids
    return ids[:, :tokens]


def chunked_ppl(model, ids, kv_dtype: str, chunk: int = PPL_CHUNK) -> float:
    """Perplexity of ids [1, T] predicted chunk by chunk through `kv_dtype`'s cache (fp16: the identity cache).
    A chunk whose logits are not finite raises NonFiniteError naming the format, the chunk and the first
    non-finite layer: the row fails rather than store a NaN perplexity."""
    import torch

    from ..finite import FiniteWatch, check_metric
    from ..method.codecs import IdentityCodec, get_codec
    from ..method.hf_cache import KVCodecCache, cache_kwarg

    codec = get_codec(kv_dtype)
    if isinstance(codec, IdentityCodec):
        cache = KVCodecCache(codec, config=model.config, sink_tokens=0)
    else:  # decoded copies kept: identical numbers, each tile decoded once
        cache = KVCodecCache(codec, config=model.config, keep_decoded=True)
    kw = cache_kwarg(model)
    ids = ids.to(next(model.parameters()).device)
    nll, n = 0.0, 0
    t = ids.shape[-1]
    with torch.inference_mode(), FiniteWatch(model, layers_only=True) as watch:
        for s in range(0, t, chunk):
            piece, tgt = ids[:, s:s + chunk], ids[0, s + 1:s + chunk + 1]
            logits = model(piece, use_cache=True, **{kw: cache}).logits
            watch.check(logits, f"for kv dtype {kv_dtype} in the perplexity window, chunk {s // chunk} (tokens "
                                f"{s}-{min(s + chunk, t) - 1})")
            lp = torch.log_softmax(logits[0, :tgt.shape[0]].float(), -1)
            nll -= lp.gather(-1, tgt[:, None]).sum().item()
            n += tgt.shape[0]
    return check_metric(math.inf if nll / n > 700 else math.exp(nll / n), f"perplexity of kv dtype {kv_dtype}")


def accuracy_metrics(ppl: float, ppl_fp16: float) -> dict:
    return {"ppl": ppl, "ppl_fp16": ppl_fp16, "ppl_delta_pct": 100.0 * (ppl / ppl_fp16 - 1.0)}
