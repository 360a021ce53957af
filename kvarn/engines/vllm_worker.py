"""The vLLM worker process of bench and eval: one fresh engine per run, vLLM imported here only.

    python -m kvarn.engines.vllm_worker SPEC.json RESULT.json   # a bench cell: mode offline | serve
    python -m kvarn.engines.vllm_worker JOB.json                # an eval job: mode generate | score

A cell writes one result to RESULT ({"status", "error", "metrics", "info"}), also when it fails. A job builds one
`vllm.LLM` from job["llm"], runs the requests in small batches and prints one `@kvarn-result {json}` line per request
as each batch finishes (the parent stores them as they arrive); a failing job exits non-zero with its traceback, a
finished one ends its engine processes, prints `@kvarn-done` and exits 0 without vLLM's own shutdown.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

from ..finite import NonFiniteError
from .gpus import GpuMemSampler
from .process import end_descendants
from .vllm_log import classify_error

RESULT_TAG = "@kvarn-result "
DONE_TAG = "@kvarn-done"  # a job's last line: every result is out
BATCH = 256  # requests per generate() call: results stream back per batch, vLLM schedules within it

# a cell times a burst with bench's own metrics and progress file, so its body lives in kvarn.bench; named here and
# imported in the worker only, so this package does not import kvarn.bench
CELL_MODES = {"offline": "kvarn.bench.engines.vllm_cell:run_offline",
              "serve": "kvarn.bench.engines.vllm_cell:run_serve"}


def emit(obj: dict) -> None:
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def generate(llm, job: dict) -> None:
    from vllm import SamplingParams

    reqs, p = job["requests"], job["params"]
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


def score(llm, job: dict) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    for r in job["requests"]:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": r["ids"]}], sp, use_tqdm=False)[0]
        nll = 0.0
        for pos, (tid, lp) in enumerate(zip(r["ids"][1:], out.prompt_logprobs[1:]), 1):
            v = lp[tid].logprob
            if not math.isfinite(v):  # summed, it would pass as a window's loss: the job fails, naming it
                raise NonFiniteError(nonfinite_logprob_message(job["llm"], r["id"], pos, v))
            nll -= v
        emit({"id": r["id"], "nll_sum": nll, "tokens": len(r["ids"]) - 1, "seconds": time.perf_counter() - t0})


def nonfinite_logprob_message(llm: dict, window, pos: int, value: float) -> str:
    dtype = llm.get("dtype") or "auto"
    hint = "try --dtype bfloat16 or float32" if dtype in ("auto", "float16") else "try --dtype float32"
    return (f"vLLM returned non-finite log-probs for kv dtype {llm.get('kv_cache_dtype', 'auto')} at window {window}, "
            f"token {pos} ({value}): the model overflows in dtype {dtype} ({hint}); no result recorded for it")


JOB_MODES = {"generate": generate, "score": score}
MODES = (*CELL_MODES, *JOB_MODES)


def run_job(job: dict) -> int:
    from vllm import LLM

    try:
        llm = LLM(**job["llm"])
        JOB_MODES[job["mode"]](llm, job)
    except BaseException:
        traceback.print_exc()
        _leave(1)
    # every result is out: vLLM's engine shutdown can still abort the interpreter ("terminate called without an
    # active exception", exit -6), which would turn a finished job into a failed row. Say so first (the parent stops
    # reading at this line), then end the engine core and its workers here instead of through vLLM
    sys.stdout.write(DONE_TAG + "\n")
    sys.stdout.flush()
    _leave(0)


def _leave(rc: int) -> None:
    """Exit now, after the engine's processes: an engine core left alive keeps its GPU memory, and the next engine
    then finds too little free."""
    end_descendants(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run_cell(spec: dict, result_path: str) -> int:
    mod, func = CELL_MODES[spec["mode"]].split(":")
    mem = GpuMemSampler()
    mem.start()
    try:
        result = getattr(importlib.import_module(mod), func)(spec)
    except BaseException as e:  # noqa: BLE001 - the row must say what happened
        text = "".join(traceback.format_exception(e))
        print(text, file=sys.stderr, flush=True)
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        result = {"status": classify_error(text), "error": f"{type(e).__name__}: {last}"[:500], "metrics": {}, "info": {}}
    result["metrics"]["gpu_mem_gib"] = mem.stop()
    Path(result_path).write_text(json.dumps(result, default=str))
    # vLLM's background threads can keep the interpreter alive; the result is written, leave now
    _leave(0)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m kvarn.engines.vllm_worker SPEC.json [RESULT.json]", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    mode = spec.get("mode")
    if mode in CELL_MODES and len(argv) == 2:
        return run_cell(spec, argv[1])
    if mode in JOB_MODES and len(argv) == 1:
        return run_job(spec)
    if mode in MODES:
        want = "SPEC.json RESULT.json" if mode in CELL_MODES else "JOB.json"
        print(f"error: mode {mode!r} takes {want}, got {len(argv)} paths", file=sys.stderr)
    else:
        print(f"error: unknown worker mode {mode!r} in {argv[0]}; accepted: {', '.join(MODES)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
