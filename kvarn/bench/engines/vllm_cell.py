"""A bench cell inside the vLLM worker process (kvarn.engines.vllm_worker, modes offline and serve): one
configuration x repeat in a fresh engine, returned as {"status", "error", "metrics", "info"}.

The spec holds the BenchConfig fields plus `workdir`. Everything vLLM prints goes to the worker's stdout/stderr,
which the orchestrator sends to DIR/logs/<hash>-r<k>.log. Offline mode drives LLM.llm_engine step by step (the
loop LLM.generate runs) to time every request's tokens and sample get_metrics(); serve mode starts `vllm serve` on a free 127.0.0.1 port and streams /v1/completions.
"""
from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ...engines.vllm_args import llm_kwargs, model_dir_for, serve_argv
from ...engines.vllm_log import BURST_MARK, log_file_error
from ..metrics import RequestRecord, max_concurrency_at, pool_blocks_from_log, summarize
from ..progress import ProgressFile
from ..prompts import random_prompts

KV_LOG = re.compile(r"GPU KV cache size:\s*([\d,]+)\s*tokens")


def metric_values(metrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in metrics:
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)):
            out[m.name] = out.get(m.name, 0.0) + float(v)
    return out


def _capacity(cc, burst: int) -> dict:
    # the pool's tokens, num_blocks x block_size: vLLM's kv_cache_size_tokens rounds down to whole requests of
    # max_model_len (the burst), which undercounts a 128-token-block pool at a burst of no whole number of tiles
    blocks = getattr(cc, "num_gpu_blocks", None)
    block = getattr(cc, "block_size", None)
    tokens = ((blocks or 0) * (block or 0)) or getattr(cc, "kv_cache_size_tokens", None) or float("nan")
    return {"kv_tokens": float(tokens), "kv_blocks": float(blocks or float("nan")),
            "max_concurrency": max_concurrency_at(blocks, block, burst)}, {"kv_block_size": block}


def _serve_capacity(pool: tuple[int, int] | None, logged: int | None, max_model_len: int,
                    block: int | None) -> tuple[float, float]:
    """(pool tokens, requests of max_model_len it holds) of a server: from its /metrics cache-config gauge (blocks,
    block size), else from its "GPU KV cache size" line inverted with the block size the format set, else that
    line as printed (vLLM chose the block size and did not say)."""
    if pool is None and logged is not None and block:
        pool = (pool_blocks_from_log(logged, max_model_len, int(block)), int(block))
    if pool is not None:
        return float(pool[0] * pool[1]), max_concurrency_at(pool[0], pool[1], max_model_len)
    if logged is None:
        return float("nan"), float("nan")
    return float(logged), logged / max_model_len


def run_offline(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    progress = ProgressFile(spec.get("workdir"))
    progress.update(force=True, phase="engine start")
    model_dir = model_dir_for(spec["model_path"], spec["workdir"])
    kwargs = llm_kwargs(spec, model_dir)
    print(f"[kvarn] LLM({kwargs})", flush=True)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    metrics, info = _capacity(llm.llm_engine.vllm_config.cache_config, spec["burst"])
    metrics["engine_start_s"] = start_s
    progress.update(force=True, phase="warm-up", **metrics)
    vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    prompts = random_prompts(spec["requests"], spec["prompt_len"], vocab, spec["seed"])
    params = SamplingParams(ignore_eos=True, max_tokens=spec["output_len"], detokenize=False,
                            temperature=1.0, top_p=1.0)
    delta = False
    try:  # only new tokens per step: no O(n^2) copying of cumulative token lists in the output processor
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.DELTA
        delta = True
    except (ImportError, AttributeError):
        pass
    engine = llm.llm_engine
    metrics["engine_start_s"] += _warm_up(llm, spec, vocab)
    preempt0 = preemption_count(metric_values(llm.get_metrics()))  # counters are cumulative: the warm-up's out
    recs: dict[str, RequestRecord] = {}
    peak_running = peak_waiting = kv_usage = 0.0
    n_done = n_out = n_out_done = 0  # requests finished, tokens generated, tokens of finished requests
    preempted = 0.0
    progress.update(force=True, phase="burst", engine_start_s=metrics["engine_start_s"], num_requests=len(prompts),
                    completed=0, generated_tokens=0, total_output_tokens=0, burst_s=0.0, burst_started_at=time.time(),
                    burst_tokens=len(prompts) * spec["output_len"])
    print(BURST_MARK, flush=True)
    start = time.perf_counter()
    try:
        for i, p in enumerate(prompts):  # the whole burst at once, as LLM.generate would submit it
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
            # keyed by our (external) id: vLLM returns an internal id with a random suffix, outputs carry ours
            recs[str(i)] = RequestRecord(prompt_len=len(p), start=start)
    except (TypeError, AttributeError, NotImplementedError) as e:
        if recs:
            raise
        print(f"[kvarn] step loop unavailable ({e}); timing LLM.generate as a whole", flush=True)
        progress.update(force=True, completed=None, generated_tokens=None, total_output_tokens=None)  # none there
        return _generate_only(llm, prompts, params, metrics, info, kwargs, preempt0)
    last_sample = 0.0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            r = recs.get(str(o.request_id)) or recs.get(str(o.request_id).rsplit("-", 1)[0])
            if r is None:
                continue
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            if delta:
                n += r.output_tokens
            if n > r.output_tokens:  # several tokens in one step (multi-step/spec decode) count as one chunk
                if r.output_tokens == 0:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - r.start - r.latency)
                r.latency = now - r.start
                n_out += n - r.output_tokens
                r.output_tokens = n
            if o.finished and not r.success:
                r.success = True
                n_done += 1
                n_out_done += r.output_tokens
        if now - last_sample > 0.25:
            last_sample = now
            vals = metric_values(llm.get_metrics())
            peak_running = max(peak_running, vals.get("vllm:num_requests_running", 0.0))
            peak_waiting = max(peak_waiting, vals.get("vllm:num_requests_waiting", 0.0))
            kv_usage = max(kv_usage, vals.get("vllm:kv_cache_usage_perc", 0.0))
            preempted = preemption_count(vals) - (0.0 if math.isnan(preempt0) else preempt0)
        # every step (the file itself is rewritten at most every few seconds)
        progress.update(completed=n_done, generated_tokens=n_out, total_output_tokens=n_out_done, burst_s=now - start,
                        peak_running=peak_running, peak_waiting=peak_waiting, kv_usage_peak=kv_usage,
                        preemptions=preempted)
    duration = time.perf_counter() - start
    vals = metric_values(llm.get_metrics())
    metrics.update(summarize(list(recs.values()), duration))
    metrics.update(peak_running=peak_running, peak_waiting=peak_waiting, kv_usage_peak=kv_usage,
                   preemptions=preemption_count(vals) - (0.0 if math.isnan(preempt0) else preempt0))
    info["vllm_kwargs"] = json.dumps(kwargs, default=str, sort_keys=True)
    done = sum(r.success for r in recs.values())
    if done < len(recs):  # a run that lost requests must not pass as a throughput figure
        return {"status": "failed", "error": f"only {done} of {len(recs)} requests completed", "metrics": metrics,
                "info": info}
    return {"status": "ok", "error": "", "metrics": metrics, "info": info}


WARMUP_REQUESTS = 2
WARMUP_OUTPUT = 8
PREEMPTIONS = ("vllm:num_preemptions", "vllm:num_preemptions_total")


def warmup_requests(requests: int, prompt_len: int, max_batched_tokens: int | None) -> int:
    """Enough prompts that their tokens overflow one step's token budget, so one prompt is split and the
    continuation-chunk path compiles too (at least WARMUP_REQUESTS; never more than the burst has)."""
    n = WARMUP_REQUESTS
    if max_batched_tokens and prompt_len > 0:
        n = max(n, max_batched_tokens // prompt_len + 1)
    return max(1, min(n, int(requests)))


def preemption_count(vals: dict) -> float:
    for k in PREEMPTIONS:
        if k in vals:
            return vals[k]
    return float("nan")


WARMUP_TILE = 128  # the largest KVarN tile (g64 presets divide it)


def warmup_burst(spec: dict, vocab: int, max_batched_tokens: int | None) -> tuple[list[list[int]], int]:
    """(prompts, output tokens) of the untimed warm-up: warmup_requests() prompts of the burst's length from other
    random ids (no prefix-cache hits carry over), WARMUP_OUTPUT tokens each (fewer if the burst asks fewer). The last
    prompt is shortened (by < WARMUP_TILE tokens) so that its decode steps complete a tile: a tile completed by a
    decode step is stored by its own code path (KVarN's in-step flush, or the deferred flush's next-step launch)."""
    requests, prompt_len = int(spec["requests"]), int(spec["prompt_len"])
    n = warmup_requests(requests, prompt_len, max_batched_tokens)
    out = max(1, min(WARMUP_OUTPUT, int(spec["output_len"])))
    prompts = random_prompts(n + 1, prompt_len, vocab, int(spec["seed"]) + 7919)  # one spare
    spare, prompts = prompts[-1], prompts[:-1]
    # decode step j (1 <= j < out) stores the token at position len + j - 1, completing a tile when len + j is a
    # multiple of the tile: len = cross completes one at j = out // 2
    cross = prompt_len - (prompt_len + out // 2) % WARMUP_TILE
    if n >= 2 and out >= 2 and cross >= 1:
        prompts[-1] = prompts[-1][:cross]
        if max_batched_tokens and sum(map(len, prompts)) <= max_batched_tokens < n * prompt_len and n < requests:
            prompts.insert(0, spare)  # the cut undid the overflow of one step's token budget: one prompt more
    return prompts, out


def _warm_up(llm, spec: dict, vocab: int) -> float:
    """A small untimed burst before the timed one (warmup_requests() x (prompt_len + WARMUP_OUTPUT), other random
    tokens, so no prefix-cache hits carry over): Triton kernels that JIT-compile on first use (KVarN's, TurboQuant's;
    first chunks, continuation chunks, decode) compile here, not inside the measured burst. Returns its seconds
    (added to engine_start_s)."""
    from vllm import SamplingParams

    t = time.perf_counter()
    sched = getattr(llm.llm_engine.vllm_config, "scheduler_config", None)
    prompts, out_len = warmup_burst(spec, vocab, getattr(sched, "max_num_batched_tokens", None))
    params = SamplingParams(ignore_eos=True, max_tokens=out_len, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


def _generate_only(llm, prompts, params, metrics, info, kwargs, preempt0: float = 0.0) -> dict:
    """Fallback without per-token times: one LLM.generate call (throughputs, counts and capacity only)."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    duration = time.perf_counter() - start
    recs = [RequestRecord(prompt_len=len(p), output_tokens=len(o.outputs[0].token_ids), success=True)
            for p, o in zip(prompts, outs)]
    metrics.update(summarize(recs, duration, timings=False))
    vals = metric_values(llm.get_metrics())
    metrics["preemptions"] = preemption_count(vals) - (0.0 if math.isnan(preempt0) else preempt0)  # not the warm-up's
    info["vllm_kwargs"] = json.dumps(kwargs, default=str, sort_keys=True)
    return {"status": "ok", "error": "", "metrics": metrics, "info": info}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(spec: dict) -> dict:
    from ..serve_client import MetricsSampler, run_load, wait_healthy

    progress = ProgressFile(spec.get("workdir"))
    progress.update(force=True, phase="engine start")
    model_dir = model_dir_for(spec["model_path"], spec["workdir"])
    kwargs = llm_kwargs(spec, model_dir)
    host, port = "127.0.0.1", free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *serve_argv(kwargs, host, port)]
    print(f"[kvarn] {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    server = subprocess.Popen(argv, stdout=sys.stdout, stderr=sys.stderr, stdin=subprocess.DEVNULL)
    try:
        try:
            wait_healthy(host, port, spec.get("start_timeout_s", 1800), proc=server)
        except (RuntimeError, TimeoutError) as e:
            # the server's own error (an OOM at KV sizing, say) is only in its log: name it, so the row says oom
            raise RuntimeError(f"{e}; server log: {log_file_error(spec.get('log_path'))}") from None
        start_s = time.perf_counter() - t0
        sys.stdout.flush()
        log_text = Path(spec["log_path"]).read_text(errors="replace") if spec.get("log_path") else ""
        kv = [int(m.replace(",", "")) for m in KV_LOG.findall(log_text)]
        sampler = MetricsSampler(host, port)  # started for the timed burst; before it, one page for the pool
        kv_tokens, concurrency = _serve_capacity(sampler.pool(), kv[-1] if kv else None,
                                                 int(kwargs.get("max_model_len") or spec["burst"]),
                                                 kwargs.get("block_size"))
        progress.update(force=True, phase="warm-up", engine_start_s=start_s, kv_tokens=kv_tokens,
                        max_concurrency=concurrency)
        vocab = int(spec.get("vocab_size", 32000))
        prompts = random_prompts(spec["requests"], spec["prompt_len"], vocab, spec["seed"])
        # the same untimed warm-up as offline mode (first-use Triton compiles), counted in engine_start_s
        t1 = time.perf_counter()
        # (the server's token budget: the one passed, else vLLM serve's usual 8192)
        warm, warm_out = warmup_burst(spec, vocab, kwargs.get("max_num_batched_tokens") or 8192)
        run_load(host, port, model_dir, warm, warm_out, seed=spec["seed"])
        start_s += time.perf_counter() - t1
        sampler.sample()
        preempt0 = preemption_count(sampler.last)  # cumulative counter: the warm-up's preemptions out
        sampler.start()
        # serve: a request's tokens are known when its stream ends (total_output_tokens: finished requests')
        progress.update(force=True, phase="burst", engine_start_s=start_s, num_requests=len(prompts), completed=0,
                        total_output_tokens=0, burst_s=0.0, burst_started_at=time.time())
        print(BURST_MARK, flush=True)
        lock, t_burst = threading.Lock(), time.perf_counter()

        def done(rec) -> None:  # from the load's sending threads; written at once (few, and nothing else writes)
            with lock:
                d = progress.data
                progress.update(force=True, completed=d["completed"] + bool(rec.success),
                                burst_s=time.perf_counter() - t_burst,
                                total_output_tokens=d["total_output_tokens"] + rec.output_tokens)

        records, duration = run_load(host, port, model_dir, prompts, spec["output_len"],
                                     request_rate=spec.get("request_rate"), burstiness=spec.get("burstiness", 1.0),
                                     max_concurrency=spec.get("concurrency_limit"), seed=spec["seed"], on_done=done)
        server_stats = sampler.stop()
        goodput = json.loads(spec.get("goodput") or "{}")
        metrics = summarize(records, duration, goodput)
        if not math.isnan(preempt0):
            server_stats["preemptions"] = server_stats["preemptions"] - preempt0
        metrics.update(server_stats)
        metrics.update(engine_start_s=start_s, kv_tokens=kv_tokens, max_concurrency=concurrency)
        errors = [r.error for r in records if not r.success]
        status = "ok" if not errors else "failed"
        err = "" if not errors else f"{len(errors)}/{len(records)} requests failed; first: {errors[0][:300]}"
        return {"status": status, "error": err, "metrics": metrics,
                "info": {"vllm_kwargs": json.dumps(kwargs, default=str, sort_keys=True)}}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
