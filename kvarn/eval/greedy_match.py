"""Greedy parity of two engines on the same prompts: how many leading tokens the vLLM backend's greedy answers share
with the reference engine's (`--engine hf`: transformers + kvarn.method.hf_cache, the PyTorch method), per KV format.

    python -m kvarn.eval.greedy_match RESULTS_DIR --model MODEL_DIR [--task gsm8k] [--max-tokens 32]

reads the `sample` rows both engines stored for the task (scripts/device/eval.sh, steps greedy_vllm / greedy_hf) and
prints, per kv dtype, the prompts compared, how many agree on the first token, on the first 8 tokens and on every
token, and the median common prefix. Greedy decoding on two engines drifts apart once a near-tie between two tokens
falls the other way (fp16 GEMM order differs), so agreement is measured as a prefix, as vLLM's own tests do.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import pandas as pd


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(samples: pd.DataFrame, encode, engines: tuple[str, str] = ("vllm", "hf")) -> list[dict]:
    """samples: sample rows of one task (columns engine, kv_dtype, sample_id, repeat, response, gen_tokens).
    encode(text) -> token ids. Returns one dict per kv dtype both engines answered."""
    a, b = engines
    out = []
    for kv, g in samples.groupby("kv_dtype", sort=False):
        x = g[g.engine == a].drop_duplicates(["sample_id", "repeat"], keep="last").set_index(["sample_id", "repeat"])
        y = g[g.engine == b].drop_duplicates(["sample_id", "repeat"], keep="last").set_index(["sample_id", "repeat"])
        keys = [k for k in x.index if k in y.index]
        if not keys:
            continue
        pref, lens, same = [], [], []
        for k in keys:
            ta, tb = encode(str(x.loc[k, "response"])), encode(str(y.loc[k, "response"]))
            pref.append(common_prefix(ta, tb))
            lens.append(min(len(ta), len(tb)))
            same.append(ta == tb)  # identical answers agree on any prefix, also when shorter than it (or empty)
        out.append({"kv_dtype": kv, "prompts": len(keys), "first_token": sum(p >= 1 or e for p, e in zip(pref, same)),
                    "first_8": sum(p >= 8 or e for p, e in zip(pref, same)), "all": sum(same),
                    "median_prefix": statistics.median(pref), "mean_len": sum(lens) / len(lens)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvarn.eval.greedy_match", description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--model", required=True, help="tokenizer folder (the weights both engines ran)")
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--max-tokens", type=int, default=None, help="only runs with this --max-tokens")
    a = ap.parse_args(argv)
    from ..results import ResultsStore

    store = ResultsStore(a.results)
    s = store.read("sample")
    if s.empty:
        print(f"no sample rows in {a.results}")
        return 1
    s = s[s.task == a.task]
    if a.max_tokens is not None:
        ev = store.read("eval")
        if not ev.empty and "protocol_max_tokens" in ev:
            hashes = set(ev[ev.protocol_max_tokens == a.max_tokens].config_hash)
            s = s[s.config_hash.isin(hashes)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    rows = compare(s, lambda t: tok(t, add_special_tokens=False)["input_ids"])
    if not rows:
        print("no prompts answered by both engines")
        return 1
    print(f"greedy parity, {a.task}: vLLM backend vs the hf reference engine (same prompts, same weights)")
    print(f"{'kv dtype':<18} {'prompts':>7} {'1st token':>9} {'first 8':>8} {'all':>5} {'median prefix':>14} "
          f"{'mean len':>9}")
    for r in rows:
        print(f"{r['kv_dtype']:<18} {r['prompts']:>7} {r['first_token']:>9} {r['first_8']:>8} {r['all']:>5} "
              f"{r['median_prefix']:>14g} {r['mean_len']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
