"""`kvarn microbench` logic: time the KVarN kernels against the 16-bit baseline a user would otherwise run,
in the same process, on the same shapes.

Baseline: vLLM's FlashAttention (`vllm.vllm_flash_attn.flash_attn_varlen_func` over a 16-bit paged cache with a
block table, as vLLM's own decode path calls it; FA3 on Hopper, else FA2) when vLLM imports, else PyTorch SDPA.
GPU timing: CUDA events around each call, warm-up first, the median of `iters` runs; decode (ours against the
baseline) from CUDA graphs of back-to-back calls replayed in turn, as vLLM runs a decode step, so launch gaps and
drift over the run do not enter the ratio. Achieved bandwidth is the
packed bytes the kernel must read over its median time, shown against a measured device-to-device copy
bandwidth. On a CPU everything runs through the Triton interpreter at small sizes: the numbers then only show
the command works (the result says so).
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..errors import KvarnError
from ..formats import get_format

GPU_DEFAULTS = dict(batch=64, context=16384, q_heads=32, kv_heads=8, head_dim=128)
CPU_DEFAULTS = dict(batch=2, context=200, q_heads=4, kv_heads=2, head_dim=64)


@dataclass
class BenchResult:
    kernel: str
    device: str
    interpreter: bool
    kv_dtype: str
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ms: float
    baseline: str
    baseline_ms: float | None
    ratio: float | None  # ours / baseline (lower is better)
    bytes: int  # bytes our kernel must move
    gbps: float
    copy_gbps: float
    bw_frac: float  # achieved / copy bandwidth
    rel_err: float | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ plumbing


def resolve_device(device: str) -> torch.device:
    d = (device or "auto").lower()
    if d == "auto":
        d = "cuda" if torch.cuda.is_available() else "cpu"
    if d.startswith("cuda") and not torch.cuda.is_available():
        raise KvarnError(f"--device {device}: no CUDA GPU is visible here; use --device cpu (Triton interpreter)")
    if not (d == "cpu" or d.startswith("cuda")):
        raise KvarnError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    dev = torch.device(d)
    if dev.type == "cpu":
        # the interpreter must be chosen before the kernel modules are imported (triton.jit reads it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return dev


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _once_ms(fn, dev: torch.device) -> float:
    """Milliseconds of one fn() (CUDA events on a GPU, perf_counter on a CPU)."""
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_ms(fn, dev: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over iters runs (CUDA events on a GPU, perf_counter on a CPU)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    return statistics.median(_once_ms(fn, dev) for _ in range(max(1, iters)))


# calls per captured graph in paired_ms: a graph launch's own GPU-side latency is shared by them (ours and the
# baseline alike). Longer graphs are longer bursts: the SM clock drops under a long hot burst, which an issue-bound
# kernel feels and a DRAM-bound one does not (--graph-calls, and --timing all with the clock read per replay)
GRAPH_CALLS = 8


TIMING_ORDERS = ("in-turn", "blocks", "gap")
GAP_S = 0.02  # "gap": host idle before each timed replay, long enough for the clocks to settle back


def _sm_clock_mhz(dev: torch.device) -> int | None:
    """The SM clock now (NVML through torch; None without pynvml): read after a timed replay, it shows the clock
    state each fn ran in (a GPU's clock drops under load, and an issue-bound kernel feels it most)."""
    try:
        return int(torch.cuda.clock_rate(dev))
    except Exception:  # noqa: BLE001 - pynvml absent or unsupported: no clock column
        return None


def paired_ms(fns, dev: torch.device, iters: int, calls: int = GRAPH_CALLS, warmup: int = 2,
              fallback: bool = True, order: str = "in-turn") -> list[float]:
    """paired_timings' milliseconds alone."""
    return [ms for ms, _how in paired_timings(fns, dev, iters, calls, warmup, fallback, order)]


def paired_timings(fns, dev: torch.device, iters: int, calls: int = GRAPH_CALLS, warmup: int = 2,
                   fallback: bool = True, order: str = "in-turn",
                   clocks: list | None = None) -> list[tuple[float, str]]:
    """(median milliseconds per call, how it was timed) of each fn in fns. GPU: each fn captured `calls` times back
    to back in one CUDA graph (no host launch gaps, as vLLM replays a decode step); a fn that cannot be captured is
    timed call by call in the same order (fallback=False: the capture error is raised). CPU: time_ms of each.
    order: "in-turn" replays the graphs alternately (A, B, A, B, ...) so clock ramps and a neighbour's load hit every
    fn alike (timed call by call, a kernel's time wanders by a third across runs while the baseline holds). But a
    fn then always starts in the power / clock state the previous
    one left: "blocks" times each fn's replays back to back in A-B-B-A blocks (its own steady state, as
    triton.testing.do_bench does; the mirrored order cancels a linear drift), "gap" keeps the alternation and idles
    the host GAP_S before each timed replay (every fn starts from the same idle state). clocks: a list to receive
    each fn's median SM clock (MHz, read after each of its timed replays; None where NVML is not there)."""
    if order not in TIMING_ORDERS:
        raise KvarnError(f"unknown timing order {order!r}; accepted: {', '.join(TIMING_ORDERS)}")
    if dev.type != "cuda":
        if clocks is not None:
            clocks.extend([None] * len(fns))
        return [(time_ms(f, dev, iters, warmup=min(warmup, 1)), "call by call (CPU)") for f in fns]
    runners, graphs = [], []
    for f in fns:
        for _ in range(warmup):  # compiles, autotuning and first-call allocations stay outside the capture
            f()
        _sync(dev)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    f()
            graphs.append(g)
            runners.append((g.replay, calls, f"CUDA graph of {calls} calls, {order}"))
        except Exception:  # noqa: BLE001 - e.g. a baseline that syncs: call by call instead
            if not fallback:
                raise
            _sync(dev)
            runners.append((f, 1, f"call by call (not capturable), {order}"))
    for run, _n, _how in runners:  # one untimed round: clocks up, graphs uploaded
        run()
    _sync(dev)
    times: list[list[float]] = [[] for _ in fns]
    mhz: list[list[int]] = [[] for _ in fns]

    def timed(i):
        run, n, _how = runners[i]
        times[i].append(_once_ms(run, dev) / n)
        if clocks is not None and (c := _sm_clock_mhz(dev)) is not None:
            mhz[i].append(c)

    n_iters = max(1, iters)
    if order == "blocks":
        half = max(1, n_iters // 2)
        for block in (list(range(len(runners))), list(reversed(range(len(runners))))):
            for i in block:
                for _ in range(half):
                    timed(i)
    else:
        for _ in range(n_iters):
            for i in range(len(runners)):
                if order == "gap":
                    time.sleep(GAP_S)  # the previous replay has synchronized: the GPU idles meanwhile
                timed(i)
    del graphs
    if clocks is not None:
        clocks.extend(int(statistics.median(m)) if m else None for m in mhz)
    return [(statistics.median(t), how) for t, (_run, _n, how) in zip(times, runners)]


def step_ms(fn, layers: int, dev: torch.device, iters: int, warmup: int = 2) -> float:
    """What fn() costs a decode step that runs it once per layer, in ms. GPU: the median replay of one CUDA graph
    holding `layers` back-to-back calls, i.e. the kernels' own time without host launch gaps, as vLLM pays it in a
    captured decode step (a small kernel timed call by call measures the Python launch instead). CPU (interpreter):
    one call's time x layers."""
    return layers * paired_ms([fn], dev, iters, calls=layers, warmup=warmup, fallback=False)[0]


def copy_bandwidth_gbps(dev: torch.device, mib: int | None = None) -> float:
    """Device copy bandwidth (read + write bytes per second), the roofline the kernels are held against."""
    n = (mib or (1024 if dev.type == "cuda" else 64)) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), dev, iters=20 if dev.type == "cuda" else 5)
    return 2 * n / (ms * 1e-3) / 1e9


def _check_sizes(batch: int, context: int, chunk: int | None = None, iters: int | None = None,
                 num_splits: int | None = None):
    # 0 is not "the default": every given size must be positive
    for flag, v in (("--batch", batch), ("--context", context), ("--chunk", chunk), ("--iters", iters),
                    ("--num-splits", num_splits)):
        if v is not None and v < 1:
            raise KvarnError(f"{flag} must be >= 1, got {v}")


def _check_heads(q_heads: int, kv_heads: int, head_dim: int):
    if kv_heads < 1 or q_heads < 1 or q_heads % kv_heads:
        raise KvarnError(f"--q-heads ({q_heads}) must be a positive multiple of --kv-heads ({kv_heads})")
    if head_dim not in (64, 128, 256):
        raise KvarnError(f"--head-dim must be 64, 128 or 256, got {head_dim}")


def _kv_format(name: str):
    fmt = get_format(name)
    if fmt.family != "kvarn":
        raise KvarnError(f"microbench times the KVarN kernels; --kv-dtype must be a kvarn_* preset, got {fmt.name}")
    return fmt


def paged_kvarn(fmt, B, ctx, Hk, D, dtype, dev, gen_seed=0):
    """A KVarN paged cache filled by our own store kernel (real records), tail buffers and metadata."""
    from ..kernels.store import store_tiles

    g = fmt.group
    n_full = ctx // g
    nb = max(1, B * n_full)
    cache = torch.zeros(nb, Hk, fmt.record_bytes(D), dtype=torch.uint8, device=dev)
    gen = torch.Generator(device=dev).manual_seed(gen_seed)
    chunk = 4096  # tiles per store launch: bounds the 16-bit staging memory
    for s in range(0, B * n_full, chunk):
        t = min(chunk, B * n_full - s)
        k = torch.randn(t, Hk, g, D, generator=gen, device=dev, dtype=dtype)
        v = torch.randn(t, Hk, g, D, generator=gen, device=dev, dtype=dtype)
        store_tiles(k, v, cache, torch.arange(s, s + t, dtype=torch.int32, device=dev), fmt)
    if n_full:  # scattered blocks, as a real paged cache has
        bt = torch.randperm(B * n_full, generator=gen, device=dev).view(B, n_full).to(torch.int32)
    else:
        bt = torch.zeros(B, 1, dtype=torch.int32, device=dev)
    # tail rows + the format's sink and window rows, as the backend allocates them (the kernels then mask their
    # positions in the records)
    sink = fmt.sink_tokens
    tail_k = torch.randn(B, Hk, fmt.tail_rows, D, generator=gen, device=dev, dtype=dtype)
    tail_v = torch.randn(B, Hk, fmt.tail_rows, D, generator=gen, device=dev, dtype=dtype)
    return dict(cache=cache, block_table=bt, tail_k=tail_k, tail_v=tail_v,
                tail_slots=torch.arange(B, dtype=torch.int32, device=dev),
                seq_lens=torch.full((B,), ctx, dtype=torch.int32, device=dev),
                sink_lens=torch.full((B,), sink, dtype=torch.int32, device=dev))


def _reference_out(st, fmt, D, q, scale, rows, causal_q=None):
    """fp32 oracle over the dequantized cache + tail (sink and window included) for the first `rows` requests
    (bounded cost): kvarn.method.paged's post-store state."""
    import numpy as np

    from ..method.paged import post_store_kv
    from ..method.reference import reference_attention

    outs = []
    for b in range(rows):
        s = int(st["seq_lens"][b])
        k, v, _ = post_store_kv(np.array([b]), np.array([s]), np.array([int(st["tail_slots"][b])]), st["cache"],
                                st["block_table"], st["tail_k"], st["tail_v"], fmt, torch.float32,
                                sink_lens=st["sink_lens"][b:b + 1])
        K, V = k.transpose(0, 1), v.transpose(0, 1)  # [Hk, s, D]
        if causal_q is None:
            outs.append(reference_attention(q[b].float()[:, None], K, V, scale)[:, 0])
        else:
            qb = q[causal_q[b]:causal_q[b + 1]].float().transpose(0, 1)
            outs.append(reference_attention(qb, K, V, scale, causal_offset=s - qb.shape[1]).transpose(0, 1))
    return outs


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ baselines


def _flash_attn():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # lazily: vLLM is optional
    except Exception:  # noqa: BLE001 - any import failure means "no vLLM FA here"
        return None
    return flash_attn_varlen_func


def _baseline_decode(B, ctx, Hq, Hk, D, dtype, dev, scale, q):
    """(name, callable, bytes) of the 16-bit attention a user would otherwise run on these shapes."""
    fa = _flash_attn() if dev.type == "cuda" else None
    if fa is not None:
        bs = 16  # vLLM's default block size for 16-bit caches
        nblk = -(-ctx // bs)
        kc = torch.randn(B * nblk, bs, Hk, D, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        bt = torch.randperm(B * nblk, device=dev).view(B, nblk).to(torch.int32)
        cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        for ver in (3, 2):
            def run(ver=ver):
                fa(q, kc, vc, max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=ctx, seqused_k=sl, softmax_scale=scale,
                   causal=True, block_table=bt, out=out, fa_version=ver)
            try:
                run()
                _sync(dev)
                return f"vllm FlashAttention {ver} (paged fp16, block 16)", run, 2 * B * ctx * Hk * D * 2
            except Exception:  # noqa: BLE001 - FA3 missing on this GPU/build: try FA2
                continue
    k = torch.randn(B, Hk, ctx, D, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    q4 = q.unsqueeze(2)

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=Hq != Hk)

    return "torch SDPA (contiguous 16-bit)", sdpa, 2 * B * ctx * Hk * D * 2


# ------------------------------------------------------------------------------------------------ targets



def bench_decode(batch, context, q_heads, kv_heads, head_dim, kv_dtype, device="auto", check=False, iters=None,
                 num_splits=None, dtype=torch.bfloat16, graph_calls: int | None = None,
                 timing: str = "in-turn") -> BenchResult:
    """Time decode_attention against the 16-bit baseline, both from CUDA graphs of `graph_calls` back-to-back calls
    (default GRAPH_CALLS). timing: a paired_timings order, or "all": each of them, in extra['orders'] (the headline
    in turn)."""
    if timing not in (*TIMING_ORDERS, "all"):
        raise KvarnError(f"unknown --timing {timing!r}; accepted: {', '.join((*TIMING_ORDERS, 'all'))}")
    dev = resolve_device(device)
    _check_heads(q_heads, kv_heads, head_dim)
    _check_sizes(batch, context, iters=iters, num_splits=num_splits)
    if graph_calls is not None and graph_calls < 1:
        raise KvarnError(f"--graph-calls must be >= 1, got {graph_calls}")
    fmt = _kv_format(kv_dtype)
    from ..kernels.decode import decode_attention, default_num_splits

    iters = iters or (50 if dev.type == "cuda" else 2)
    B, ctx, Hq, Hk, D = batch, context, q_heads, kv_heads, head_dim
    st = paged_kvarn(fmt, B, ctx, Hk, D, dtype, dev)
    q = torch.randn(B, Hq, D, device=dev, dtype=dtype)
    scale = 1 / math.sqrt(D)
    out = torch.empty_like(q)

    def run(dst=out):
        decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                         st["tail_slots"], fmt, scale, num_splits=num_splits, out=dst, sink_lens=st["sink_lens"])

    g = fmt.group
    nbytes = B * Hk * ((ctx // g) * fmt.record_bytes(D) + (ctx % g) * D * 2 * 2) + q.numel() * 2 * 2
    bname, bfn, _bbytes = _baseline_decode(B, ctx, Hq, Hk, D, dtype, dev, scale, q)
    calls = graph_calls or GRAPH_CALLS
    orders = TIMING_ORDERS if timing == "all" else (timing,)
    by_order, mhz = {}, {}
    for o in orders:
        mhz[o] = []
        by_order[o] = paired_timings([run, bfn], dev, iters, calls, warmup=3 if dev.type == "cuda" else 1, order=o,
                                     clocks=mhz[o])
    (ms, how), (bms, bhow) = by_order[orders[0]]  # "all": the headline stays in turn, the others beside it
    copy = copy_bandwidth_gbps(dev)
    gbps = nbytes / (ms * 1e-3) / 1e9
    err, extra = None, {}
    if check:
        rows = min(B, 4)
        run()
        ref = torch.stack(_reference_out(st, fmt, D, q, scale, rows))
        out32 = torch.empty(q.shape, dtype=torch.float32, device=dev)  # the kernel's own precision
        run(out32)
        err = _rel(out32[:rows], ref)
        extra = {"rel_err_in_q_dtype": _rel(out[:rows], ref)}
    extra["timing"] = f"ours: {how}; baseline: {bhow}"  # a baseline timed call by call carries its launch
    if len(orders) > 1:
        extra["orders"] = {o: {"ms": a, "baseline_ms": b, "ratio": a / b if b else None,
                               "sm_mhz": mhz[o][0], "baseline_sm_mhz": mhz[o][1]}
                           for o, ((a, _), (b, _)) in by_order.items()}
    elif mhz[orders[0]] and mhz[orders[0]][0] is not None:
        extra["sm_mhz"] = f"ours {mhz[orders[0]][0]}, baseline {mhz[orders[0]][1]} (median after each replay)"
    extra["splits"] = num_splits or default_num_splits(B, Hk, st["block_table"].shape[1], dev)
    return BenchResult("decode", str(dev), dev.type == "cpu", fmt.name, B, ctx, Hq, Hk, D, ms, bname, bms,
                       ms / bms if bms else None, nbytes, gbps, copy, gbps / copy, err,
                       {"num_splits": num_splits, "ideal_ratio_bytes": fmt.record_bytes(D) / (fmt.group * 4 * D),
                        **extra})


def bench_prefill(batch, context, q_heads, kv_heads, head_dim, kv_dtype, device="auto", check=False, iters=None,
                  chunk=None, dtype=torch.bfloat16) -> BenchResult:
    """Time the backend's continuation-chunk path (kvarn.vllm_plugin.dense_prefill: records dequantized + tail into
    16-bit K/V, then FlashAttention varlen where vLLM has it, else torch) against FlashAttention (or SDPA) over a
    16-bit paged cache of the same context. The step's gather indexes are built in the warm-up call, as a step's
    first layer builds them: the timed calls are what each further layer pays."""
    dev = resolve_device(device)
    _check_heads(q_heads, kv_heads, head_dim)
    _check_sizes(batch, context, chunk, iters=iters)
    fmt = _kv_format(kv_dtype)
    iters = iters or (20 if dev.type == "cuda" else 1)
    B, ctx, Hq, Hk, D = batch, context, q_heads, kv_heads, head_dim
    chunk = min(chunk or (512 if dev.type == "cuda" else 16), ctx)
    st = paged_kvarn(fmt, B, ctx, Hk, D, dtype, dev)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev) * chunk
    q = torch.randn(B * chunk, Hq, D, device=dev, dtype=dtype)
    scale = 1 / math.sqrt(D)
    # baseline: FA varlen, causal, chunk queries over a 16-bit paged cache of the same context
    fa = _flash_attn() if dev.type == "cuda" else None
    bname, bms, fa_ver = "none", None, None
    if fa is not None:
        bs = 16
        nblk = -(-ctx // bs)
        kc = torch.randn(B * nblk, bs, Hk, D, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        bt = torch.randperm(B * nblk, device=dev).view(B, nblk).to(torch.int32)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        for ver in (3, 2):
            def base(ver=ver):
                fa(q, kc, vc, max_seqlen_q=chunk, cu_seqlens_q=qsl, max_seqlen_k=ctx, seqused_k=sl,
                   softmax_scale=scale, causal=True, block_table=bt, out=torch.empty_like(q), fa_version=ver)
            try:
                base()
                _sync(dev)
                bms = time_ms(base, dev, iters)
                bname, fa_ver = f"vllm FlashAttention {ver} (paged fp16, causal varlen)", ver
                break
            except Exception:  # noqa: BLE001
                continue
    if bms is None:
        k = torch.randn(B, Hk, ctx, D, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        q4 = q.view(B, chunk, Hq, D).transpose(1, 2)
        mask = (torch.arange(ctx, device=dev)[None, :] <= (ctx - chunk + torch.arange(chunk, device=dev))[:, None])
        bname = "torch SDPA (contiguous 16-bit, causal mask)"
        bms = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != Hk), dev, iters)
    what, ours = _dense_prefill_runner(st, fmt, q, qsl, scale, fa if fa_ver else None, fa_ver)
    ms = time_ms(ours, dev, iters, warmup=2 if dev.type == "cuda" else 1)
    g = fmt.group
    nbytes = B * Hk * ((ctx // g) * fmt.record_bytes(D) + (ctx % g) * D * 4) + 2 * q.numel() * 2
    copy = copy_bandwidth_gbps(dev)
    gbps = nbytes / (ms * 1e-3) / 1e9
    err = None
    if check:
        rows = min(B, 2)
        ref = torch.cat(_reference_out(st, fmt, D, q, scale, rows, causal_q=[int(x) for x in qsl.tolist()]))
        err = _rel(ours()[: rows * chunk].float(), ref)
    return BenchResult("prefill", str(dev), dev.type == "cpu", fmt.name, B, ctx, Hq, Hk, D, ms, bname, bms,
                       ms / bms if bms else None, nbytes, gbps, copy, gbps / copy, err,
                       {"chunk": chunk, "path": what})


def _dense_prefill_runner(st, fmt, q, qsl, scale, fa, fa_ver):
    """(what runs, callable) of the backend's dense prefill path on these inputs, every request one continuation
    chunk that reads the stored state (the chunk's own tokens are in the cache already)."""
    import numpy as np

    from ..vllm_plugin.dense_prefill import dense_prefill
    from ..vllm_plugin.step_plan import continuation_plan

    # each timed call is one layer of the step (the warm-up call, its first, prepares the launches)
    plan = continuation_plan(qsl.cpu().numpy().astype(np.int64), st["seq_lens"].cpu().numpy(),
                             st["tail_slots"].cpu().numpy(), st["block_table"], fmt.group, st["sink_lens"])
    dec = "Triton decoder" if st["cache"].is_cuda else "reference decoder"
    varlen, what = None, f"{dec} + torch varlen"
    if fa is not None:
        def varlen(q_, k_, v_, cu, max_len, cu_k=None, max_k=None, out=None):
            return fa(q_, k_, v_, max_seqlen_q=max_len, cu_seqlens_q=cu, max_seqlen_k=max_k, cu_seqlens_k=cu_k,
                      softmax_scale=scale, causal=True, fa_version=fa_ver, out=out)

        what = f"{dec} + FlashAttention {fa_ver} varlen"
    return what, lambda: dense_prefill(plan, q, st["cache"], st["block_table"], st["tail_k"], st["tail_v"], fmt, scale,
                                       varlen)


def bench_store(batch, context, q_heads, kv_heads, head_dim, kv_dtype, device="auto", check=False, iters=None,
                model="qwen3-8b", dtype=torch.bfloat16, balance_iters: list[int] | None = None) -> BenchResult:
    """One tile flush (one request, every KV head) x the model's layers, against one decode step's attention
    (decode_attention at --batch/--context x layers). The baseline column is that decode step. On a GPU the flush
    is timed as a decode step pays it: the layers' flushes replayed from one CUDA graph (step_ms); the call-by-call
    time with its host launch is reported beside it (flush_host_ms_all_layers). balance_iters: balancing iteration
    counts to time the flush at, side by side (extra['flush_ms_by_iters']; default: the format's own)."""
    dev = resolve_device(device)
    from ..kernels.decode import decode_attention
    from ..kernels.store import flush_layers, store_tiles
    from ..shapes import resolve_model

    shape = resolve_model(model)
    _check_heads(q_heads, kv_heads, head_dim)
    _check_sizes(batch, context, iters=iters)
    fmt = _kv_format(kv_dtype)
    if balance_iters is not None and (not balance_iters or any(not 1 <= n <= 64 for n in balance_iters)):
        raise KvarnError(f"--balance-iters {balance_iters}: accepted are counts in 1..64, e.g. 8,3")
    iters = iters or (50 if dev.type == "cuda" else 2)
    g, H, D, L = fmt.group, kv_heads, head_dim, shape.num_layers
    k = torch.randn(1, H, g, D, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    cache = torch.zeros(2, H, fmt.record_bytes(D), dtype=torch.uint8, device=dev)
    ids = torch.ones(1, dtype=torch.int32, device=dev)
    one = time_ms(lambda: store_tiles(k, v, cache, ids, fmt), dev, iters, warmup=2 if dev.type == "cuda" else 1)
    flush_ms = step_ms(lambda: store_tiles(k, v, cache, ids, fmt), L, dev, iters)
    by_iters = {n: step_ms(lambda n=n: store_tiles(k, v, cache, ids, fmt, n), L, dev, iters)
                for n in (balance_iters or []) if n != fmt.balance_iters}
    # a whole batch flushing at once (worst case step)
    kb = torch.randn(batch, H, g, D, device=dev, dtype=dtype)
    vb = torch.randn_like(kb)
    cb = torch.zeros(batch, H, fmt.record_bytes(D), dtype=torch.uint8, device=dev)
    idb = torch.arange(batch, dtype=torch.int32, device=dev)
    allb_ms = step_ms(lambda: store_tiles(kb, vb, cb, idb, fmt), L, dev, max(1, iters // 5), warmup=1)
    # the same tile of every layer in one launch (flush_layers: L caches and tails reached through an address
    # table), as a deferred flush runs it once per step: GPU time (graph) and call time (eager, host included)
    tails_k = [torch.randn(2, H, fmt.tail_rows, D, device=dev, dtype=dtype) for _ in range(L)]
    tails_v = [torch.randn_like(t) for t in tails_k]
    caches = [torch.zeros(2, H, fmt.record_bytes(D), dtype=torch.uint8, device=dev) for _ in range(L)]
    one_slot = torch.zeros(1, dtype=torch.int32, device=dev)
    layers_fn = lambda: flush_layers(tails_k, tails_v, caches, one_slot, ids, fmt)  # noqa: E731
    layers_ms = step_ms(layers_fn, 1, dev, iters)
    layers_host_ms = time_ms(layers_fn, dev, iters, warmup=1)
    st = paged_kvarn(fmt, batch, context, H, D, dtype, dev)
    q = torch.randn(batch, q_heads, D, device=dev, dtype=dtype)
    dec = time_ms(lambda: decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"],
                                           st["tail_v"], st["tail_slots"], fmt, 1 / math.sqrt(D),
                                           sink_lens=st["sink_lens"], win_lens=None), dev, iters)
    attn_ms = dec * L
    nbytes = H * (2 * g * D * 2 + fmt.record_bytes(D))
    copy = copy_bandwidth_gbps(dev)
    gbps = nbytes / (flush_ms / L * 1e-3) / 1e9
    err, check_extra = None, {}
    if check:
        # decoded difference to the reference's tiles (a near-tie in the best-iterate choice can pick another,
        # equally good iterate: a few % here is expected), plus both quantization errors against the input
        from ..method.reference import dequantize_tiles, quantize_tiles

        store_tiles(k, v, cache, ids, fmt)
        kd, vd = dequantize_tiles(cache[1:2], fmt, D)
        kr, vr = dequantize_tiles(quantize_tiles(k, v, fmt), fmt, D)
        err = max(_rel(kd, kr), _rel(vd, vr))
        check_extra = {"quant_err_v_ours": _rel(vd, v[0:1]), "quant_err_v_reference": _rel(vr, v[0:1]),
                       "quant_err_k_ours": _rel(kd, k[0:1]), "quant_err_k_reference": _rel(kr, k[0:1])}
    extra = {**check_extra, "model": shape.name, "layers": L, "balance_iters": fmt.balance_iters,
             "flush_ms_all_layers": flush_ms, "flush_host_ms_all_layers": one * L, "decode_step_attn_ms": attn_ms,
             "flush_frac_of_step": flush_ms / attn_ms, "batch_flush_ms_all_layers": allb_ms,
             "amortized_frac": (batch / g) * flush_ms / attn_ms, "flush_layers_ms": layers_ms,
             "flush_layers_host_ms": layers_host_ms, "flush_layers_frac_of_step": layers_ms / attn_ms}
    if by_iters:
        extra["flush_ms_by_iters"] = {fmt.balance_iters: flush_ms, **by_iters}
    return BenchResult("store", str(dev), dev.type == "cpu", fmt.name, batch, context, q_heads, kv_heads, D,
                       flush_ms, f"decode attention step x {L} layers", attn_ms, flush_ms / attn_ms, nbytes, gbps,
                       copy, gbps / copy, err, extra)


TARGETS = {"decode": bench_decode, "prefill": bench_prefill, "store": bench_store}
