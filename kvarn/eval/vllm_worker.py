"""Subprocess body of the vLLM eval engine: `python -m kvarn.eval.vllm_worker JOB.json`.

Builds one `vllm.LLM` from job["llm"], runs the requests in small batches, and prints one
`KVARN_RESULT {json}` line per request as each batch finishes (the parent stores them as they arrive).
"""
from __future__ import annotations

import json
import sys
import time

TAG = "KVARN_RESULT "
BATCH = 256  # requests per generate() call: results stream back per batch, vLLM schedules within it


def emit(obj: dict) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(path: str) -> int:
    job = json.loads(open(path).read())
    from vllm import LLM, SamplingParams

    llm = LLM(**job["llm"])
    reqs = job["requests"]
    if job["mode"] == "generate":
        p = job["params"]
        for b in range(0, len(reqs), BATCH):
            part = reqs[b:b + BATCH]
            sps = [SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"],
                                  top_p=p["top_p"] if p["temperature"] > 0 else 1.0, seed=r["seed"],
                                  stop=p["stop"] or None) for r in part]
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": r["ids"]} for r in part], sps, use_tqdm=False)
            dt = (time.perf_counter() - t0) / max(1, len(part))
            for r, o in zip(part, outs):
                c = o.outputs[0]
                emit({"id": r["id"], "k": r["k"], "text": c.text, "gen_tokens": len(c.token_ids),
                      "finish_reason": c.finish_reason or "", "prompt_tokens": len(r["ids"]), "seconds": dt})
    elif job["mode"] == "score":
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
        for r in reqs:
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": r["ids"]}], sp, use_tqdm=False)[0]
            nll = 0.0
            for tid, lp in zip(r["ids"][1:], out.prompt_logprobs[1:]):
                nll -= lp[tid].logprob
            emit({"id": r["id"], "nll_sum": nll, "tokens": len(r["ids"]) - 1, "seconds": time.perf_counter() - t0})
    else:
        raise SystemExit(f"unknown mode {job['mode']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
