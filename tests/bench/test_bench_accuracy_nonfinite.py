"""The hf bench row's perplexity axis with a model that overflows in float16: an error naming the format, the chunk
and the layer (the cell's row then fails), never a NaN perplexity; in float32 the same model gives a number."""
from __future__ import annotations

import math

import pytest

from kvarn.bench.accuracy import chunked_ppl, window_ids
from kvarn.finite import NonFiniteError

pytest.importorskip("transformers")


def _load(model_dir, dtype):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return m, window_ids(AutoTokenizer.from_pretrained(model_dir), tokens=256)


@pytest.mark.parametrize("kv", ["auto", "kvarn_k4v2_g128"])
def test_overflow_names_format_chunk_and_layer(overflow_model, kv):
    m, ids = _load(overflow_model[0], "float16")
    with pytest.raises(NonFiniteError) as e:
        chunked_ppl(m, ids, kv)
    msg = str(e.value)
    assert f"for kv dtype {kv} in the perplexity window, chunk 0 (tokens 0-127)" in msg
    assert "model.layers.1" in msg and "float16" in msg and "--dtype" in msg


def test_float32_gives_a_finite_perplexity(overflow_model):
    m, ids = _load(overflow_model[0], "float32")
    ppl = chunked_ppl(m, ids, "kvarn_k4v2_g128")
    assert math.isfinite(ppl) and ppl > 1
