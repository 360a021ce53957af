"""The accuracy axis of a bench row: chunked perplexity of a short Moby-Dick window through the row's KV format.

The window goes through the model in chunks of `chunk` tokens, every chunk attending to the earlier chunks as the
format stored them (kvarn.method.fidelity.chunked_eval), in lockstep with the fp16 cache, so each row carries its
own fp16 reference and its change against it. Only rows with real weights get one (random weights predict nothing).
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


def chunked_ppl(model, ids, kv_dtype: str, chunk: int = PPL_CHUNK) -> dict:
    """{ppl, ppl_fp16, ppl_delta_pct} of ids [1, T] with `kv_dtype`'s cache (fp16: the reference itself)."""
    import torch

    from ..method.codecs import IdentityCodec, get_codec
    from ..method.fidelity import REF, chunked_eval

    codec = get_codec(kv_dtype)
    ids = ids.to(next(model.parameters()).device)
    with torch.inference_mode():
        acc = chunked_eval(model, ids, [codec], chunk)
    ref = math.exp(acc[REF.name]["nll_sum"] / acc[REF.name]["n"])
    ppl = ref if isinstance(codec, IdentityCodec) else math.exp(acc[codec.name]["nll_sum"] / acc[codec.name]["n"])
    return {"ppl": ppl, "ppl_fp16": ref, "ppl_delta_pct": 100.0 * (ppl / ref - 1.0)}
