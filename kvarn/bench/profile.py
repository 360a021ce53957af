"""`kvarn profile`: where one decode (or prefill) step of a vLLM engine spends its time, each cost next to its floor.

For each KV dtype, one fresh engine process (dummy weights, a bundled shape, in-process engine core so the profiler
sees the model's kernels) fills B requests to context C (prefill), runs a few warm-up decode steps, then times N
decode steps with CUDA events and records them with `torch.profiler` (CPU + CUDA activities). With phase "prefill"
it profiles the fill instead: a warm-up fill of other prompts of the same lengths (one token each, so prefix caching
cannot serve the profiled ones), then every engine step until all B requests have their first token (the batch's
time to first token). GPU kernel time is
aggregated by category (`classify`), host time of the KVarN plugin's per-step plan (and of its per-layer store /
attention Python) is accumulated by a perf_counter hook around `kvarn.vllm_plugin.ops` functions (same behaviour,
only timed and labelled with `torch.profiler.record_function`). Floors are bytes that must move / HBM bandwidth:

* attention: KV read per step = sum_i(ctx_i) x layers x kv_heads x slot bytes (KVarN: full tiles at the packed
  slot bytes, the unfinished tile 16-bit, shown on the tail row); the FP16 equivalent is reported beside it;
* store: bytes written (and the 16-bit tokens read) by the tile flushes / new-token writes of a step;
* GEMMs: weight bytes read per step (input embedding excluded unless tied to the LM head).

A prefill step is compute-bound: its GEMM floor is 2 x (parameters but the LM head) x tokens, plus the LM head
once per request, / peak FLOP/s; its attention floor the causal QK and PV FLOPs of the step's tokens over their
prefixes; the store floor is bytes as above (KVarN's tile flushes; its 16-bit tail writes on the glue row).

    python -m kvarn.bench.profile SPEC.json RESULT.json      (the engine worker; `profile()` starts it)
"""
from __future__ import annotations

import bisect
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

from ..errors import KvarnError
from ..formats import get_format
from .parsing import parse_engine_args

HBM_BYTES_PER_S = 4.1e12  # H200 copy bandwidth (BENCHMARKS.md measures 4.17 TB/s)
PEAK_FLOPS = 989e12  # H200 dense 16-bit tensor-core peak (the data sheet's, without sparsity)
PHASES = ("decode", "prefill")
STAGGER_SPAN = 128  # prompt lengths are spread over one tile so flushes are amortised as in serving
WARMUP_STEPS = 3
MAX_FILL_STEPS = 100000  # an engine that never emits the first tokens: an error, not a spin until the timeout

# (key, label) in table order
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("kv_store", "KV store (KVarN tile flush / vLLM reshape_and_cache)"),
    ("kvarn_decode", "KVarN decode attention (query scale, split-K records + tail, merge)"),
    ("kvarn_prefill", "KVarN prefill attention"),
    ("kvarn_tail", "KVarN tail (16-bit unfinished tile)"),
    ("kvarn_glue", "KVarN glue (torch index/copy in store/attention)"),
    ("flash_attention", "FlashAttention"),
    ("gemm", "GEMMs (nvjet/cutlass/cublas)"),
    ("norm_rope_act", "norms / rope / activations (incl. Inductor fused)"),
    ("sampling", "sampling"),
    ("runner", "vLLM input prep (block tables, slots, positions)"),
    ("memcpy", "memcpy / memset"),
    ("other", "other"),
)
LABELS = dict(CATEGORIES)
ANNOTATION_PREFIX = "kvarn::"

_RULES: tuple[tuple[str, re.Pattern], ...] = tuple((k, re.compile(p, re.I)) for k, p in (
    ("kv_store", r"_store_tiles_kernel|_flush_layers_kernel|reshape_and_cache|concat_and_cache"),
    ("kvarn_tail", r"_decode_tail_kernel"),
    ("kvarn_decode", r"records_kernel|(^|[^a-z_])merge_kernel|_dequant_kernel"),
    ("flash_attention", r"flash|fmha|FlashAttn|BatchDecodeWithPagedKVCache|BatchPrefillWith|"
                        r"kernel_unified_attention|paged_attention"),
    ("gemm", r"nvjet|gemm|gemv|cutlass|cublas|xmma|splitKreduce|wgmma|triton_tem_fused_.*mm|_matmul"),
    ("sampling", r"_temperature_kernel|_gumbel_sample|_topk_topp|_penalties_kernel|_bincount_kernel|_min_p_kernel|"
                 r"_bias_kernel|_bad_words|logprob|_ranks_kernel|softmax|SoftMax|ArgMax|argmax|topk|sort|"
                 r"exponential|distribution_|multinomial|sample"),
    ("norm_rope_act", r"rms_norm|layer_norm|layernorm|rotary|rope|act_and_mul|silu|gelu|swiglu|"
                      r"triton_(poi|red|per)_fused"),
    ("runner", r"_gather_block_tables|_compute_slot_mappings|_prepare_pos_seq_lens|_prepare_prefill_inputs|"
               r"_post_update|_combine_sampled_and_draft|_expand_idx_mapping|_apply_write_kernel|"
               r"_get_num_sampled_and_rejected|_dcp_local_seq_lens"),
    ("memcpy", r"^memcpy|^memset|Memcpy|Memset"),
))


def classify(name: str, annotation: str | None = None) -> str:
    """Category key of a GPU kernel name; `annotation` is the enclosing `kvarn::...` host range, if any."""
    cat = "other"
    for key, pat in _RULES:
        if pat.search(name):
            cat = key
            break
    if cat == "kvarn_decode" and annotation and "[prefill]" in annotation:
        return "kvarn_prefill"
    if annotation and annotation.startswith(ANNOTATION_PREFIX) and cat in ("other", "memcpy"):
        return "kvarn_glue"  # index / gather / copy kernels the plugin's torch code launches
    return cat


# ---------------------------------------------------------------------------------------------------------------
# floors


def floor_ms(nbytes: float, bw: float = HBM_BYTES_PER_S) -> float:
    return 1e3 * nbytes / bw


def kv_read_bytes(kv_dtype: str, ctx_lens, layers: int, kv_heads: int, head_dim: int) -> dict:
    """Bytes one decode step must read from the KV cache, split into packed (quantized full tiles or the paged
    cache) and 16-bit tail (KVarN's unfinished tile), and the FP16 equivalent of the same tokens."""
    fmt = get_format(kv_dtype)
    per = layers * kv_heads
    fp16_slot = 4 * head_dim  # K + V, 2 bytes each
    tokens = sum(int(c) for c in ctx_lens)
    if fmt.family == "kvarn":
        g = int(fmt.group)
        full = sum((int(c) // g) * g for c in ctx_lens)
        packed = full * per * fmt.slot_bytes(head_dim)
        tail = (tokens - full) * per * fp16_slot
    else:
        packed = tokens * per * fmt.slot_bytes(head_dim)
        tail = 0
    return {"packed": float(packed), "tail": float(tail), "total": float(packed + tail),
            "fp16_equivalent": float(tokens * per * fp16_slot), "tokens": tokens}


def store_bytes(kv_dtype: str, new_tokens: float, tiles: float, layers: int, kv_heads: int, head_dim: int) -> dict:
    """Bytes a step's KV writes move. KVarN: each flushed tile reads g 16-bit tokens and writes one record per head;
    every new token goes 16-bit to the tail (read + write). Others: every new token read once and written once."""
    fmt = get_format(kv_dtype)
    per = layers * kv_heads
    fp16_slot = 4 * head_dim
    if fmt.family == "kvarn":
        flush = tiles * per * (fmt.record_bytes(head_dim) + int(fmt.group) * fp16_slot)
        tail = new_tokens * per * 2 * fp16_slot
        return {"flush": float(flush), "tail": float(tail)}
    return {"flush": float(new_tokens * per * (fp16_slot + fmt.slot_bytes(head_dim))), "tail": 0.0}


def weight_read_bytes(shape, dtype: str | None = None) -> float:
    """Weights a decode step reads: all of them but the input embedding table (only looked up) unless tied."""
    total = shape.weight_bytes(dtype)
    if not shape.config.get("tie_word_embeddings"):
        from ..shapes import DTYPE_BYTES

        total -= shape.vocab_size * shape.hidden_size * DTYPE_BYTES[dtype or shape.dtype]
    return float(total)


def prefill_flops(prompt_lens, layers: int, q_heads: int, head_dim: int, params: float) -> dict:
    """FLOPs of prefilling these prompts from scratch: GEMMs 2 x params per token; attention, causal, QK and PV
    2 x 2 x q_heads x head_dim per (query, key) pair, n (n + 1) / 2 pairs per prompt of n tokens."""
    tokens = sum(int(n) for n in prompt_lens)
    pairs = sum(int(n) * (int(n) + 1) // 2 for n in prompt_lens)
    return {"gemm": 2.0 * params * tokens, "attention": 4.0 * q_heads * head_dim * pairs * layers,
            "tokens": tokens}


def prefill_store_bytes(kv_dtype: str, prompt_lens, layers: int, kv_heads: int, head_dim: int) -> dict:
    """Bytes the fill's KV writes move, as store_bytes splits them: KVarN flushes every full tile ("flush", the
    store kernel) and writes the rest to its 16-bit tail ("tail", torch indexing); the others write every token
    once ("flush")."""
    fmt = get_format(kv_dtype)
    if fmt.family != "kvarn":
        return store_bytes(kv_dtype, sum(int(n) for n in prompt_lens), 0, layers, kv_heads, head_dim)
    g = int(fmt.group)
    tiles = sum(int(n) // g for n in prompt_lens)
    rest = sum(int(n) % g for n in prompt_lens)
    return store_bytes(kv_dtype, rest, tiles, layers, kv_heads, head_dim)


def prompt_lengths(batch: int, context: int, stagger: bool) -> list[int]:
    """Request i's prompt: context - (i * 128 // batch) % 128 with stagger (tile flushes spread over the steps)."""
    if not stagger:
        return [context] * batch
    return [max(1, context - (i * STAGGER_SPAN // max(batch, 1)) % STAGGER_SPAN) for i in range(batch)]


# ---------------------------------------------------------------------------------------------------------------
# trace aggregation (kineto's chrome trace: kernels linked to their launch through "correlation")


def _union_us(intervals) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def aggregate_trace(events: list[dict]) -> dict:
    """GPU time (us) per category, busy (union) and span of the kernels, top kernels, from trace events."""
    launches: dict = {}
    ann: dict = {}
    gpu = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in ("cuda_runtime", "cuda_driver", "runtime", "driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (e.get("tid"), float(e["ts"]))
        elif cat == "user_annotation" and str(e.get("name", "")).startswith(ANNOTATION_PREFIX):
            ann.setdefault(e.get("tid"), []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                                                     e["name"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append(e)
    for v in ann.values():
        v.sort()
    starts = {t: [a for a, _, _ in v] for t, v in ann.items()}

    def annotation_of(corr):
        hit = launches.get(corr)
        if hit is None or hit[0] not in ann:
            return None
        tid, ts = hit
        i = bisect.bisect_right(starts[tid], ts) - 1  # kvarn:: ranges of one thread are disjoint
        if i >= 0 and ts <= ann[tid][i][1]:
            return ann[tid][i][2]
        return None

    by_cat: dict[str, float] = {k: 0.0 for k, _ in CATEGORIES}
    by_kernel: dict[tuple, list] = {}
    intervals = []
    for e in gpu:
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        name = str(e.get("name", ""))
        if e.get("cat") != "kernel" and not name.lower().startswith("mem"):
            name = ("Memcpy " if e.get("cat") == "gpu_memcpy" else "Memset ") + name
        a = annotation_of((e.get("args") or {}).get("correlation"))
        c = classify(name, a)
        by_cat[c] += dur
        k = by_kernel.setdefault((c, name[:120]), [0.0, 0])
        k[0] += dur
        k[1] += 1
        intervals.append((ts, ts + dur))
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) if intervals else 0.0
    top = sorted(((v[0], v[1], c, n) for (c, n), v in by_kernel.items()), reverse=True)[:25]
    return {"category_us": by_cat, "busy_us": _union_us(intervals), "span_us": span, "kernels": len(gpu),
            "top": [{"category": c, "name": n, "us": us, "count": cnt} for us, cnt, c, n in top]}


# ---------------------------------------------------------------------------------------------------------------
# host hook around the plugin's plan builder / store / attention (no behaviour change)


class PluginHook:
    def __init__(self):
        self.active = False
        self.reset()

    def reset(self):
        self.plan_s = self.store_s = self.attn_s = 0.0
        self.plan_calls = self.tiles = self.new_tokens = 0

    def install(self) -> bool:
        try:
            from ..vllm_plugin import ops, step_plan
        except Exception:  # noqa: BLE001 - no plugin: nothing to time
            return False
        if getattr(step_plan.plan_step, "_kvarn_profiled", False):
            return True
        import torch

        build, store, attention = step_plan.plan_step, ops.store, ops.attention
        hook = self

        def plan_step(*a, **kw):
            t0 = time.perf_counter()
            plan = build(*a, **kw)
            if hook.active:
                hook.plan_s += time.perf_counter() - t0
                hook.plan_calls += 1
                # a decode step's flushes happen on the device (store_decode): count them from the host lengths
                hook.tiles += (int(((plan.seq_lens > 0) & (plan.seq_lens % plan.group == 0)).sum())
                               if plan.decode_only else int(plan.num_tiles))
                hook.new_tokens += int(plan.num_tokens)
            return plan

        def store_(plan, *a, **kw):
            t0 = time.perf_counter()
            with torch.profiler.record_function("kvarn::store"):
                r = store(plan, *a, **kw)
            if hook.active:
                hook.store_s += time.perf_counter() - t0
            return r

        def attention_(plan, *a, **kw):
            kind = ("prefill" if not len(plan.dec_rows) else
                    "decode" if not len(plan.cont_rows) and plan.raw_span is None else "mixed")
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"kvarn::attention[{kind}]"):
                r = attention(plan, *a, **kw)
            if hook.active:
                hook.attn_s += time.perf_counter() - t0
            return r

        for fn in (plan_step, store_, attention_):
            fn._kvarn_profiled = True
        step_plan.plan_step, ops.store, ops.attention = plan_step, store_, attention_
        return True


HOOK = PluginHook()


# ---------------------------------------------------------------------------------------------------------------
# the engine worker


def run_worker(spec: dict) -> dict:
    import torch

    from ..shapes import DTYPE_BYTES, resolve_model
    from ..engines.vllm_args import llm_kwargs, model_dir_for
    from .prompts import random_prompts

    hooked = HOOK.install()
    shape = resolve_model(spec["model"])
    B, C, N = int(spec["batch"]), int(spec["context"]), int(spec["steps"])
    warm = int(spec.get("warmup", WARMUP_STEPS))
    lens = prompt_lengths(B, C, spec.get("stagger", True))
    out_len = warm + N + 8
    cfg = {"kv_dtype": spec["kv_dtype"], "tp": 1, "gpu_memory_utilization": spec.get("gpu_memory_utilization", 0.9),
           "seed": 0, "burst": max(lens) + out_len, "dummy_weights": True,
           "max_num_seqs": B if B > 256 else None, "engine_args": spec.get("engine_args") or {}}
    model_dir = model_dir_for(str(shape.path), spec["workdir"])
    kwargs = llm_kwargs(cfg, model_dir)
    print(f"[kvarn profile] LLM({kwargs})", flush=True)
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = int(engine.vllm_config.model_config.get_vocab_size())
    prompts = [p[:n] for p, n in zip(random_prompts(B, C, vocab, 0), lens)]
    params = SamplingParams(ignore_eos=True, max_tokens=out_len, detokenize=False, temperature=1.0, top_p=1.0)
    phase = spec.get("phase", "decode")
    warm_fill_s = None
    if phase == "prefill":  # the first fill of these lengths, on other prompts, outside the window
        once = SamplingParams(ignore_eos=True, max_tokens=1, detokenize=False, temperature=1.0, top_p=1.0)
        for i, p in enumerate(random_prompts(B, C, vocab, 1)):
            engine.add_request(f"warm{i}", {"prompt_token_ids": p[:lens[i]]}, once)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        warm_fill_s = time.perf_counter() - t0
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    got: set[str] = set()

    def fill_step() -> None:
        for o in engine.step():
            rid = str(o.request_id)
            rid = rid if rid.isdigit() else rid.rsplit("-", 1)[0]  # external id, or vLLM's suffixed internal one
            if o.outputs and len(o.outputs[0].token_ids):
                got.add(rid)
        if len(got) < B and not engine.has_unfinished_requests():
            raise RuntimeError(f"prefill did not finish: {len(got)} of {B} requests produced a token")

    from torch.profiler import ProfilerActivity, profile

    trace_dir = Path(spec.get("trace_dir") or spec["workdir"])
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace_path = trace_dir / f"trace-{spec['kv_dtype']}.json"
    ev, wall = [], []

    def timed_step(step) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        step()
        b.record()
        wall.append(time.perf_counter() - t)
        ev.append((a, b))

    def fill(step) -> int:  # until every request has its first token; returns the steps it took
        n = 0
        while len(got) < B and n < MAX_FILL_STEPS:
            step()
            n += 1
        if len(got) < B:
            raise RuntimeError(f"prefill did not finish in {n} steps: {len(got)} of {B} requests have a token")
        return n

    def profiled(body):  # body() under torch.profiler with the plugin hook on; returns (profiler, body's result)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            HOOK.active = True
            res = body()
            torch.cuda.synchronize()
            HOOK.active = False
        return p, res

    HOOK.reset()
    if phase == "prefill":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof, fill_steps = profiled(lambda: fill(lambda: timed_step(fill_step)))
        fill_s, N = time.perf_counter() - t0, fill_steps
    else:
        t0 = time.perf_counter()
        fill_steps = fill(fill_step)
        fill_s = time.perf_counter() - t0
        for _ in range(warm):
            engine.step()
        torch.cuda.synchronize()

        def window() -> None:
            for _ in range(N):
                timed_step(engine.step)

        prof, _ = profiled(window)
    event_ms = [a.elapsed_time(b) for a, b in ev]
    span_ms = ev[0][0].elapsed_time(ev[-1][1])
    prof.export_chrome_trace(str(trace_path))
    agg = aggregate_trace(json.loads(trace_path.read_text()).get("traceEvents", []))
    if not spec.get("trace_dir"):
        trace_path.unlink(missing_ok=True)
    wdtype = kwargs.get("dtype") or shape.dtype
    wdtype = wdtype if wdtype in ("float16", "bfloat16", "float32") else "bfloat16"
    decoded = 1 + warm  # tokens each request holds beyond its prompt when the window starts (approx. with async)
    ctx = list(lens) if phase == "prefill" else [n + decoded + N / 2.0 for n in lens]  # mean context over the window
    return {
        "status": "ok", "error": "", "kv_dtype": spec["kv_dtype"], "model": shape.name, "batch": B, "context": C,
        "phase": phase, "steps": N, "warmup": warm, "stagger": bool(spec.get("stagger", True)), "prompt_lens": lens,
        "mean_ctx": sum(ctx) / B, "ctx": ctx, "warm_fill_s": warm_fill_s,
        "layers": shape.num_layers, "q_heads": shape.num_q_heads, "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "weight_read_bytes": weight_read_bytes(shape, wdtype),
        "lm_head_params": float(shape.vocab_size * shape.hidden_size), "weight_bytes_per_param": DTYPE_BYTES[wdtype],
        "engine_start_s": start_s, "fill_s": fill_s, "fill_steps": fill_steps,
        "wall_ms": 1e3 * sum(wall) / N, "event_ms_median": sorted(event_ms)[N // 2], "event_span_ms": span_ms,
        "trace": agg, "trace_path": str(trace_path) if spec.get("trace_dir") else None,
        "hook": {"installed": hooked, "plan_ms": 1e3 * HOOK.plan_s, "plan_calls": HOOK.plan_calls,
                 "store_host_ms": 1e3 * HOOK.store_s, "attn_host_ms": 1e3 * HOOK.attn_s, "tiles": HOOK.tiles,
                 "new_tokens": HOOK.new_tokens},
        "kv_tokens": float(getattr(engine.vllm_config.cache_config, "num_gpu_blocks", 0) or 0)
        * float(getattr(engine.vllm_config.cache_config, "block_size", 0) or 0),
    }


def worker_main(argv: list[str]) -> int:
    spec_path, result_path = argv
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run_worker(spec)
    except BaseException as e:  # noqa: BLE001 - the result must say what happened
        text = "".join(traceback.format_exception(e))
        print(text, file=sys.stderr, flush=True)
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        result = {"status": "failed", "error": f"{type(e).__name__}: {last}"[:500], "kv_dtype": spec.get("kv_dtype")}
    Path(result_path).write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)  # vLLM's background threads can keep the interpreter alive


# ---------------------------------------------------------------------------------------------------------------
# orchestration and the table


def check_environment() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise KvarnError("kvarn profile needs vLLM 0.26 and a CUDA GPU: vLLM is not installed here")
    try:
        import torch

        ok = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        raise KvarnError("kvarn profile needs vLLM 0.26 and a CUDA GPU: no CUDA GPU is visible")


def profile(model: str, kv_dtypes: list[str], batch: int, context: int, steps: int, trace_dir: str | None = None,
            workdir: str | None = None, timeout_s: float = 600, stagger: bool = True, warmup: int = WARMUP_STEPS,
            gpu_memory_utilization: float = 0.9, phase: str = "decode", log=print,
            engine_args: list[str] | None = None) -> list[dict]:
    """One engine subprocess per KV dtype, one after another; returns each worker's result (with rows).
    engine_args: extra vLLM engine arguments, `key=value` (as `kvarn bench --engine-arg`)."""

    import tempfile

    from ..shapes import resolve_model
    from ..engines.launch import Launcher, child_env

    if batch < 1 or context < 1 or steps < 1:
        raise KvarnError(f"--batch, --context and --steps must be >= 1 (got {batch}, {context}, {steps})")
    if phase not in PHASES:
        raise KvarnError(f"--phase {phase!r} is not a phase; accepted: {', '.join(PHASES)}")
    for d in kv_dtypes:
        get_format(d)
    extra = parse_engine_args(engine_args)
    resolve_model(model)
    check_environment()
    root = Path(workdir or tempfile.mkdtemp(prefix="kvarn-profile-"))
    results = []
    for d in kv_dtypes:
        wd = root / d
        wd.mkdir(parents=True, exist_ok=True)
        spec = {"model": model, "kv_dtype": d, "phase": phase, "batch": batch, "context": context, "steps": steps,
                "warmup": warmup, "stagger": stagger, "workdir": str(wd),
                "trace_dir": str(Path(trace_dir).resolve()) if trace_dir else None,
                "gpu_memory_utilization": gpu_memory_utilization, "engine_args": extra}
        (wd / "spec.json").write_text(json.dumps(spec))
        # the engine core in this process: the profiler sees the model's kernels
        env = child_env(force={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        cmd = [sys.executable, "-m", "kvarn.bench.profile", str(wd / "spec.json"), str(wd / "result.json")]
        log(f"[kvarn profile] {d}: engine process (log {wd / 'worker.log'})")
        pr = Launcher().run(cmd, wd / "worker.log", timeout_s, env=env,
                            engine_args={"gpu_memory_utilization": gpu_memory_utilization, **extra})
        rp = wd / "result.json"
        if pr.timed_out:
            r = {"status": "timeout", "error": f"timed out after {timeout_s:.0f} s", "kv_dtype": d}
        elif rp.exists():
            r = json.loads(rp.read_text())
        else:
            kind, line = pr.failure()
            r = {"status": kind, "error": f"worker exit {pr.returncode}: {line[:300]}", "kv_dtype": d}
        r["log"] = str(wd / "worker.log")
        if r.get("status") == "ok":
            r["rows"] = step_rows(r)
        results.append(r)
    return results


def _decode_floors(r: dict) -> tuple[dict, float]:
    """Per-step floors (ms) of a decode window by category, and of the whole step: bytes / HBM bandwidth."""
    N = r["steps"]
    hook = r.get("hook") or {}
    layers, hk, d = r["layers"], r["kv_heads"], r["head_dim"]
    kv = kv_read_bytes(r["kv_dtype"], r["ctx"], layers, hk, d)
    tiles = hook.get("tiles", 0) / N if hook.get("plan_calls") else _expected_tiles(r) / N
    st = store_bytes(r["kv_dtype"], r["batch"], tiles, layers, hk, d)
    floors = {"gemm": r["weight_read_bytes"], "kv_store": st["flush"]}
    if get_format(r["kv_dtype"]).family == "kvarn":
        floors.update(kvarn_decode=kv["packed"], kvarn_tail=kv["tail"] + st["tail"])
    else:
        floors["flash_attention"] = kv["total"]
    r["floors"] = {"kv_read": kv, "store": st, "tiles_per_step": tiles, "weights": r["weight_read_bytes"],
                   "bandwidth_bytes_per_s": HBM_BYTES_PER_S}
    step = floor_ms(r["weight_read_bytes"] + kv["total"] + st["flush"] + st["tail"])
    return {k: floor_ms(v) for k, v in floors.items()}, step


def _prefill_floors(r: dict) -> tuple[dict, float]:
    """Per-step floors (ms) of a fill: GEMM and attention FLOPs / peak, KV writes / HBM bandwidth."""
    N, lens = r["steps"], r["prompt_lens"]
    body = r["weight_read_bytes"] / r["weight_bytes_per_param"] - r["lm_head_params"]
    fl = prefill_flops(lens, r["layers"], r["q_heads"], r["head_dim"], body)
    gemm = fl["gemm"] + 2.0 * r["lm_head_params"] * len(lens)  # at least one row of logits per request
    st = prefill_store_bytes(r["kv_dtype"], lens, r["layers"], r["kv_heads"], r["head_dim"])
    g = get_format(r["kv_dtype"]).group
    tiles = sum(int(n) // int(g) for n in lens) if g else 0
    r["floors"] = {"gemm_flops": gemm, "attention_flops": fl["attention"], "store": st, "tokens": fl["tokens"],
                   "tiles_per_step": tiles / N, "peak_flops": PEAK_FLOPS, "bandwidth_bytes_per_s": HBM_BYTES_PER_S}
    floors = {"gemm": 1e3 * gemm / PEAK_FLOPS / N, "flash_attention": 1e3 * fl["attention"] / PEAK_FLOPS / N,
              "kv_store": floor_ms(st["flush"]) / N}
    if st["tail"]:
        floors["kvarn_glue"] = floor_ms(st["tail"]) / N
    return floors, sum(floors.values())


def step_rows(r: dict) -> list[dict]:
    """Table rows of one dtype: category, ms per step, share of the GPU busy time, floor ms, ratio to it."""
    N = r["steps"]
    agg, hook = r["trace"], r.get("hook") or {}
    busy = agg["busy_us"] / 1e3 / N
    phase = r.get("phase", "decode")
    floors, step_floor = (_prefill_floors if phase == "prefill" else _decode_floors)(r)
    rows = []
    for key, label in CATEGORIES:
        ms = agg["category_us"].get(key, 0.0) / 1e3 / N
        if ms == 0 and key not in floors:
            continue
        fl = floors.get(key)
        rows.append({"key": key, "category": label, "ms": ms, "share": ms / busy if busy else 0.0,
                     "floor_ms": fl, "x_floor": (ms / fl) if fl else None})
    idle = max(0.0, (agg["span_us"] - agg["busy_us"]) / 1e3 / N)
    rows.append({"key": "gpu_busy", "category": "GPU busy (sum above, overlap removed)", "ms": busy, "share": 1.0,
                 "floor_ms": step_floor, "x_floor": busy / step_floor if step_floor else None})
    rows.append({"key": "gpu_idle", "category": "GPU idle between kernels (host-bound gaps)", "ms": idle,
                 "share": None, "floor_ms": None, "x_floor": None})
    rows.append({"key": "step", "category": f"{phase} step (CUDA events, median)", "ms": r["event_ms_median"],
                 "share": None, "floor_ms": step_floor, "x_floor": r["event_ms_median"] / step_floor})
    rows.append({"key": "wall", "category": f"{phase} step (host wall, engine.step)", "ms": r["wall_ms"],
                 "share": None, "floor_ms": None, "x_floor": None})
    if hook.get("plan_calls"):
        graph = " (none: full CUDA graph)" if not hook["store_host_ms"] and not hook["attn_host_ms"] else ""
        for key, label, v in (("host_plan", "host: KVarN plan build (Python)", hook["plan_ms"]),
                              ("host_store", "host: KVarN store calls, all layers" + graph, hook["store_host_ms"]),
                              ("host_attn", "host: KVarN attention calls, all layers" + graph, hook["attn_host_ms"])):
            rows.append({"key": key, "category": label, "ms": v / N, "share": None, "floor_ms": None,
                         "x_floor": None})
    return rows


def _expected_tiles(r: dict) -> float:
    """Tiles completed over the window when no plan hook counted them (non-KVarN dtypes: 0 is irrelevant)."""
    fmt = get_format(r["kv_dtype"])
    if fmt.family != "kvarn":
        return 0.0
    g, start = int(fmt.group), 1 + int(r.get("warmup", WARMUP_STEPS))
    return float(sum((n + start + r["steps"]) // g - (n + start) // g for n in r["prompt_lens"]))


def main_entry() -> int:
    return worker_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main_entry())
