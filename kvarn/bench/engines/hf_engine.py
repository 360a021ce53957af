"""The hf engine: transformers on whatever device there is (CUDA, else CPU), so `kvarn bench` runs without a GPU.

The burst runs as batches of up to `max_num_seqs` requests (default: all at once): one prefill, then a decode
loop with per-step timing, so TTFT/TPOT/ITL/E2EL keep their `vllm bench serve` meaning. Quantized formats store
K/V through kvarn.method.hf_cache.KVCodecCache (real packed bytes; each stored unit decoded once, its copy kept
beside it, so the attention reads the numbers serving reads); FP16 uses transformers' DynamicCache. Runs in-process: the timeout is checked between decode steps.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import time
from pathlib import Path

from ...engines.hf import kv_cache, last_logits_only
from ...errors import KvarnError
from ...formats import get_format
from ...models import SMOLLM2
from ...shapes import resolve_model
from ..accuracy import PPL_CHUNK, PPL_TOKENS, accuracy_metrics, chunked_ppl, window_ids
from ..config import BenchConfig, Cell
from ..metrics import RequestRecord, summarize
from ..prompts import random_prompts
from .base import Engine, EngineResult, register_engine


def hf_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(shape_dtype: str) -> str:
    """CPU runs float32 (bf16 matmuls are slow there); a GPU runs the model's own dtype."""
    return shape_dtype if hf_device() == "cuda" else "float32"


def _torch_dtype(name: str):
    from ...finite import torch_dtype

    return torch_dtype(name)


def load_hf_model(cfg: BenchConfig, device: str):
    """(model, seconds, tokenizer or None). Dummy weights: random init from config.json (seeded), no tokenizer.
    Real: the weights source, with its tokenizer when it has one (the accuracy window needs it)."""
    import torch

    t0 = time.perf_counter()
    dtype = _torch_dtype(cfg.model_dtype or "float32")
    src = cfg.weights
    tok = None
    if cfg.dummy_weights or not src:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(cfg.model_path)
        config = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif src == SMOLLM2:
        from ...method.textdata import load_model

        model, tok = load_model(src, device="cpu", dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True)  # never a download
        try:
            tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
        except (OSError, ValueError):  # weights without a tokenizer: the row gets no accuracy, the burst still runs
            tok = None
    model = model.to(device).eval()
    return model, time.perf_counter() - t0, tok


def _hf_cache():  # transformers is an extra: import the cache module only when the hf engine runs
    from ...method import hf_cache

    return hf_cache


def _codecs():
    from ...method import codecs

    return codecs


def _cache_bytes(cache) -> float:
    if hasattr(cache, "memory_bytes"):  # what the format stores: packed units, 16-bit tail and sink
        held = cache.memory_bytes()
        return float(held["total"] - held.get("decoded", 0))
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "numel"):
                total += _codecs().storage_bytes(t)
    return float(total)


@register_engine("hf")
class HfEngine(Engine):
    name = "hf"
    modes = ("offline",)
    default_timeout_s = 900.0

    def __init__(self):
        self._models: dict[tuple, tuple] = {}
        self._ppl_fp16: dict[tuple, float] = {}

    def check(self, configs: list[BenchConfig]) -> None:
        super().check(configs)
        if importlib.util.find_spec("transformers") is None:
            raise KvarnError("--engine hf needs transformers; install it with: pip install 'kvarn[data]'")
        for c in configs:
            if c.tp != 1:
                raise KvarnError(f"--tp {c.tp}: the hf engine runs on one device; use --tp 1 or --engine vllm")
            if c.engine_args not in ("{}", ""):
                raise KvarnError("--engine-arg passes vLLM engine arguments; the hf engine takes none")

    def max_tp(self, engine_args: dict) -> tuple[int | None, str]:
        return 1, "the hf engine runs on one device (tensor parallelism needs --engine vllm and GPUs)"

    @staticmethod
    def _model_key(cfg: BenchConfig) -> tuple:
        return cfg.model_path, cfg.weights, cfg.dummy_weights, cfg.model_dtype, cfg.seed if cfg.dummy_weights else 0

    def _model(self, cfg: BenchConfig, device: str):
        key = self._model_key(cfg)
        if key not in self._models:
            self._models.clear()  # one model in memory at a time
            self._models[key] = load_hf_model(cfg, device)
        return self._models[key]

    def run(self, cell: Cell, timeout_s: float) -> EngineResult:
        log_path = Path(cell.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log, _capture_logs(log):
            log.write(f"[kvarn] hf engine: {json.dumps(cell.config.hash_fields(), default=str)} repeat {cell.repeat}\n")
            try:
                with _cpu_threads():
                    return self._run(cell, timeout_s, log)
            except KvarnError as e:
                log.write(f"error: {e}\n")
                return EngineResult("failed", str(e))
            except Exception as e:  # noqa: BLE001 - a failing configuration is a row, not a crash
                import traceback

                log.write(traceback.format_exc())
                text = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                status = "oom" if "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError" else "failed"
                return EngineResult(status, text[:500])

    def _run(self, cell: Cell, timeout_s: float, log) -> EngineResult:
        import torch

        cfg = cell.config
        device = hf_device()
        deadline = time.monotonic() + timeout_s
        model, load_s, tok = self._model(cfg, device)
        vocab = int(model.config.get_text_config().vocab_size)
        prompts = random_prompts(cfg.requests, cfg.prompt_len, vocab, cfg.seed)
        batch = cfg.max_num_seqs or cfg.requests
        records: list[RequestRecord] = []
        kv_bytes = 0.0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        from ...finite import FiniteWatch

        # every forward's logits are checked (a NaN is never a throughput): a non-finite one fails the cell, naming
        # the format, the batch, the step and the first non-finite layer
        with torch.inference_mode(), FiniteWatch(model, layers_only=True) as watch:
            for b in range(0, len(prompts), batch):
                chunk = prompts[b:b + batch]
                cache = kv_cache(cfg.kv_dtype, model)
                ids = torch.tensor(chunk, dtype=torch.long, device=device)
                t_send = time.perf_counter()  # later batches queue from the burst start, as in an engine
                recs = [RequestRecord(prompt_len=len(p), start=start) for p in chunk]
                ckw = _hf_cache().cache_kwarg(model)
                out = model(input_ids=ids, use_cache=True, **{ckw: cache}, **last_logits_only(model))
                what = f"for kv dtype {cfg.kv_dtype}, batch {b // batch}"
                watch.check(out.logits[:, -1], f"{what}, prefill")
                nxt = out.logits[:, -1].argmax(-1)
                now = time.perf_counter()
                for r in recs:
                    r.ttft, r.latency, r.output_tokens = now - start, now - start, 1
                for step in range(1, cfg.output_len):
                    if time.monotonic() > deadline:
                        return EngineResult("timeout", f"no result after {timeout_s:.0f} s (hf engine stopped "
                                                       f"between decode steps)", {"wall_s": time.perf_counter() - start})
                    out = model(input_ids=nxt[:, None], use_cache=True, **{ckw: cache})
                    watch.check(out.logits[:, -1], f"{what}, decode step {step}")
                    nxt = out.logits[:, -1].argmax(-1)
                    now = time.perf_counter()
                    for r in recs:
                        r.itl.append(now - r.start - r.latency)
                        r.latency = now - r.start
                        r.output_tokens += 1
                for r in recs:
                    r.success = True
                records += recs
                kv_bytes = max(kv_bytes, _cache_bytes(cache))
                log.write(f"[kvarn] batch {b // batch}: {len(chunk)} requests in {now - t_send:.2f} s\n")
        duration = time.perf_counter() - start
        m = summarize(records, duration)
        m.update(engine_start_s=load_s, kv_cache_gib=kv_bytes / (1 << 30), peak_running=float(min(batch, len(prompts))),
                 preemptions=0.0)
        if device == "cuda":
            m["gpu_mem_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
        info = {"hf_device": device, "model_dtype": str(model.dtype).replace("torch.", "")}
        if tok is not None and not cfg.dummy_weights:
            t_ppl = time.perf_counter()
            ids = window_ids(tok)
            key = self._model_key(cfg)
            if key not in self._ppl_fp16:  # one fp16 reference per model, shared by every format's row
                self._ppl_fp16[key] = chunked_ppl(model, ids, "auto")
            ref = self._ppl_fp16[key]
            m.update(accuracy_metrics(ref if get_format(cfg.kv_dtype).family == "fp16" else
                                      chunked_ppl(model, ids, cfg.kv_dtype), ref))
            log.write(f"[kvarn] chunked perplexity of {PPL_TOKENS} Moby-Dick tokens (chunks of {PPL_CHUNK}): "
                      f"{m['ppl']:.3f} (fp16 {m['ppl_fp16']:.3f}) in {time.perf_counter() - t_ppl:.1f} s\n")
        return EngineResult("ok", "", m, info)


CPU_THREADS = 1


@contextlib.contextmanager
def _cpu_threads():
    """One intra-op thread on a CPU: a small model's decode ops are too small to gain from splitting, and split ops
    wait for each other whenever another process holds a core (a shared 2-core box ran decode steps 10x and the
    prefill 4x slower with two threads than with one)."""
    import torch

    if hf_device() != "cpu":
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def _capture_logs(stream: io.TextIOBase):
    """transformers/torch warnings go to the cell's log file, not the terminal."""
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stderr(stream), contextlib.redirect_stdout(stream):
            yield
    finally:
        root.removeHandler(handler)


__all__ = ["HfEngine", "load_hf_model", "resolve_model", "default_dtype"]
