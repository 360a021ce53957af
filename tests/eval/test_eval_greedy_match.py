"""The greedy-parity comparer (kvarn.eval.greedy_match) counts shared leading tokens per kv dtype."""
from __future__ import annotations

import pandas as pd

from kvarn.eval.greedy_match import common_prefix, compare


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([5, 6], [5, 6, 7]) == 2


def test_compare_counts_per_kv_dtype():
    rows = []
    for eng, kv, sid, text in [
        ("vllm", "auto", "a", "x y z"), ("hf", "auto", "a", "x y z"),
        ("vllm", "auto", "b", "p q r s"), ("hf", "auto", "b", "p q t s"),
        ("vllm", "kvarn_k4v2_g128", "a", "x y z"), ("hf", "kvarn_k4v2_g128", "a", "w y z"),
        ("vllm", "kvarn_k4v2_g128", "b", "p"),  # hf never answered b: not compared
        ("hf", "kvarn_k4v2_g128", "a", "stale"),  # an older row of the same prompt: the last one counts
    ]:
        rows.append({"engine": eng, "kv_dtype": kv, "sample_id": sid, "repeat": 0, "response": text})
    df = pd.DataFrame(rows)
    df = pd.concat([df.iloc[:5], df.iloc[7:8], df.iloc[5:7]])  # "stale" before the kept hf row of k4v2/a
    out = {r["kv_dtype"]: r for r in compare(df, str.split)}
    assert out["auto"]["prompts"] == 2 and out["auto"]["first_token"] == 2 and out["auto"]["all"] == 1
    assert out["auto"]["median_prefix"] == 2.5
    k = out["kvarn_k4v2_g128"]
    assert k["prompts"] == 1 and k["first_token"] == 0 and k["all"] == 0


def test_compare_empty_and_early_stop():
    """Two empty answers (a stop string at once on both engines) agree; an empty answer against a non-empty one, or
    an answer that stops where the other goes on, does not."""
    rows = [{"engine": e, "kv_dtype": "auto", "sample_id": sid, "repeat": 0, "response": t}
            for sid, (tv, th) in {"e": ("", ""), "f": ("", "x"), "g": ("x y", "x y z")}.items()
            for e, t in (("vllm", tv), ("hf", th))]
    r = compare(pd.DataFrame(rows), str.split)[0]
    assert r["prompts"] == 3 and r["first_token"] == 2 and r["first_8"] == 1 and r["all"] == 1
