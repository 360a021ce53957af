"""Token-id prompts: exact lengths (decoding random ids to text and re-tokenizing it changes their number),
reproducible from the seed."""
from __future__ import annotations

import random


def random_prompts(n: int, length: int, vocab_size: int, seed: int, skip_low: int = 10) -> list[list[int]]:
    """`n` prompts of `length` ids drawn from [skip_low, vocab_size) (low ids are usually special tokens).

    Each request gets different ids, so prefix caching never shares blocks between requests of a burst.
    """
    rng = random.Random(seed)
    lo, hi = min(skip_low, vocab_size - 1), vocab_size - 1
    return [[rng.randint(lo, hi) for _ in range(length)] for _ in range(n)]
