"""Engines that `kvarn eval` drives: `hf` (transformers, in process, the method's KV cache) and `vllm` (one
subprocess per kv dtype running `vllm.LLM`, results streamed back as JSON lines; timeouts and crashes become
failed rows, never hangs). Both take token-id prompts built here, so the two see identical inputs.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .. import models
from ..engines import gpus
from ..engines.hf import kv_cache, last_logits_only
from ..engines.launch import Launcher, child_env
from ..engines.vllm_args import engine_kwargs
from ..engines.vllm_worker import DONE_TAG, RESULT_TAG
from ..errors import KvarnError
from ..formats import KVFormat


def parse_kv_args(spec: str | None) -> dict:
    """'k=v,k2=v2' (as lm-eval's --model_args) -> dict with ints/floats/bools converted."""
    out: dict = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise KvarnError(f"bad --model-args entry {part!r}; expected key=value")
        k, v = part.split("=", 1)
        v = v.strip()
        low = v.lower()
        val: object = v
        if low in ("true", "false"):
            val = low == "true"
        else:
            for cast in (int, float):
                try:
                    val = cast(v)
                    break
                except ValueError:
                    pass
        out[k.strip()] = val
    return out


@dataclass
class GenRequest:
    id: str
    k: int
    prompt_ids: list[int]
    seed: int


@dataclass
class GenParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    chunk: int | None = None  # prefill budget: prompts enter the cache in chunks of this many tokens


@dataclass
class GenResult:
    id: str
    k: int
    text: str
    gen_tokens: int
    truncated: bool
    finish_reason: str
    prompt_tokens: int
    seconds: float = 0.0


@dataclass
class ScoreResult:
    id: str
    nll_sum: float
    tokens: int
    seconds: float = 0.0


class EngineError(KvarnError):
    """An engine run that failed for one kv dtype (recorded as a failed/timeout/oom row; the others go on)."""

    def __init__(self, msg: str, status: str = "failed"):
        super().__init__(msg)
        self.status = status


def pick_engine(engine: str) -> tuple[str, str]:
    """('hf'|'vllm', why)."""
    e = (engine or "auto").lower()
    if e not in ("auto", "hf", "vllm"):
        raise KvarnError(f"unknown --engine {engine!r}; accepted: auto, vllm, hf")
    if e == "vllm":
        if not gpus.vllm_available():
            raise KvarnError("--engine vllm: vLLM is not installed here (pip install 'kvarn[vllm]'), or use --engine hf")
        return "vllm", "requested"
    if e == "hf":
        return "hf", "requested"
    if gpus.vllm_available() and gpus.gpu_available():
        return "vllm", "auto: vLLM and a GPU are present"
    return "hf", "auto: " + ("no GPU" if gpus.vllm_available() else "vLLM not installed") + ", using transformers"


def model_source(model: str, weights: str | None) -> str:
    """What to load: --weights if given, else --model: an installed kvarn.models name loads its converted folder;
    otherwise the name itself (a local folder, 'smollm2-135m' from its GGUF, or a hub id in the cache)."""
    if weights:
        return weights
    d = models.installed(model)
    return str(d) if d is not None else model


def load_tokenizer(src: str):
    from ..method.textdata import SMOLLM2, smollm2_gguf

    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise KvarnError("kvarn eval needs transformers for tokenizers: pip install 'kvarn[data]'") from None
    if src.strip().lower() in (SMOLLM2, "smollm2", "smollm2-135m-instruct"):
        f = smollm2_gguf()
        return AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    try:
        return AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise KvarnError(f"cannot load the tokenizer of {src!r}: {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------------------------------------------------------------
def _pick_token(logits, temperature: float, top_p: float):
    """One token from a [vocab] logit row: argmax (temperature 0), else a draw from the softmax at `temperature`
    cut to the smallest set of mass >= top_p (transformers' TopPLogitsWarper), from torch's global generator."""
    import torch

    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1:
        p, idx = probs.sort(descending=True)
        p = p * ((p.cumsum(-1) - p) < top_p)  # keep a token while the mass before it is under top_p
        probs = torch.zeros_like(probs).scatter(-1, idx, p)
    return torch.multinomial(probs / probs.sum(), 1)[0]


class HFEngine:
    """transformers in process; the KV cache of each request is kvarn.engines.hf.kv_cache(kv dtype)."""

    name = "hf"

    def __init__(self, src: str, device: str | None = None, model=None, tokenizer=None, dtype: str | None = None):
        import torch

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if model is None:
            from ..finite import load_dtype
            from ..method.textdata import load_model

            model, tokenizer = load_model(src, device=self.device, dtype=load_dtype(dtype))
        self.model, self.tokenizer = model, tokenizer
        from ..method.hf_cache import cache_kwarg

        self.cache_kw = cache_kwarg(model)

    @property
    def dtype(self) -> str:
        from ..finite import dtype_name

        return dtype_name(self.model)

    def _prefill(self, ids, cache, chunk: int | None, watch, what: str, last_only: bool = False):
        """Feed ids [1, T] into the cache in chunks (each chunk attends to the stored, quantized earlier ones); a
        chunk whose logits are not finite raises, naming `what` (format, request), the chunk and the module.
        `last_only`: each chunk's logits at its last position only (generation reads the prompt's last one)."""
        import torch

        t = ids.shape[-1]
        step = chunk or t
        logits = []
        keep = last_logits_only(self.model) if last_only else {}
        with torch.no_grad():
            for s in range(0, t, step):
                out = self.model(ids[:, s:s + step], use_cache=True, **{self.cache_kw: cache}, **keep)
                watch.check(out.logits, f"{what}, prefill tokens {s}-{min(s + step, t) - 1}")
                logits.append(out.logits)
        return logits

    def _watch(self):
        from ..finite import FiniteWatch

        # the decoder layers and top-level modules only: a flag per linear layer cost ~25% of a CPU decode step
        return FiniteWatch(self.model, layers_only=True)

    @staticmethod
    def _failed(e) -> EngineError:
        return EngineError(str(e), "failed")

    def generate(self, fmt: KVFormat, requests: list[GenRequest], params: GenParams) -> Iterator[GenResult]:
        from ..finite import NonFiniteError

        with self._watch() as watch:
            try:
                yield from self._generate(fmt, requests, params, watch)
            except NonFiniteError as e:  # a failed row for this format, with where it went non-finite
                raise self._failed(e) from None

    def _generate(self, fmt: KVFormat, requests: list[GenRequest], params: GenParams, watch) -> Iterator[GenResult]:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

        tok = self.tokenizer
        eos = tok.eos_token_id

        class StopOnText(StoppingCriteria):
            def __init__(self, start: int):
                self.start = start

            def __call__(self, input_ids, scores, **kw):
                if not params.stop:
                    return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
                tail = tok.decode(input_ids[0, self.start:][-32:])
                hit = any(s in tail for s in params.stop)
                return torch.full((input_ids.shape[0],), hit, dtype=torch.bool, device=input_ids.device)

        class CheckFinite(LogitsProcessor):
            """Every decode step's logits, before sampling reads them."""

            def __init__(self, what: str):
                self.what, self.step = what, 0

            def __call__(self, input_ids, scores):
                self.step += 1
                watch.check(scores, f"{self.what}, decode step {self.step}")
                return scores

        for r in requests:
            t0 = time.perf_counter()
            ids = torch.tensor([r.prompt_ids], device=self.device)
            cache = kv_cache(fmt.name, self.model)
            sample = params.temperature > 0
            if sample:
                torch.manual_seed(r.seed)
            what = f"for kv dtype {fmt.name}, problem {r.id}"
            # the first token comes from the prompt's own prefill (its chunks read their own tokens raw), as on
            # vLLM; generate() then feeds one token at a time, each step reading the stored cache
            last = self._prefill(ids, cache, params.chunk, watch, what, last_only=True)[-1][0, -1].float()
            first = _pick_token(last, params.temperature if sample else 0.0, params.top_p)
            out = torch.cat([ids, first.view(1, 1)], -1)
            if params.max_tokens > 1 and first.item() != eos:
                kw = dict(max_new_tokens=params.max_tokens - 1, do_sample=sample, pad_token_id=eos,
                          stopping_criteria=StoppingCriteriaList([StopOnText(ids.shape[-1])]),
                          logits_processor=LogitsProcessorList([CheckFinite(what)]))
                if sample:
                    kw.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
                else:
                    kw.update(temperature=None, top_p=None, top_k=None)
                with torch.no_grad():
                    out = self.model.generate(out, attention_mask=torch.ones_like(out), **{self.cache_kw: cache},
                                              **kw)
            new = out[0, ids.shape[-1]:].tolist()
            text = tok.decode(new, skip_special_tokens=False)
            reason = "length"
            if eos is not None and eos in new:
                new = new[:new.index(eos)]
                text = tok.decode(new, skip_special_tokens=False)
                reason = "stop"
            cut = min((text.find(s) for s in params.stop if s in text), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
            n = len(out[0]) - ids.shape[-1]
            yield GenResult(r.id, r.k, text, n, reason == "length" and n >= params.max_tokens, reason,
                            len(r.prompt_ids), time.perf_counter() - t0)

    def score(self, fmt: KVFormat, windows: list[tuple[str, list[int]]], chunk: int) -> Iterator[ScoreResult]:
        from ..finite import NonFiniteError

        with self._watch() as watch:
            try:
                yield from self._score(fmt, windows, chunk, watch)
            except NonFiniteError as e:
                raise self._failed(e) from None

    def _score(self, fmt: KVFormat, windows: list[tuple[str, list[int]]], chunk: int, watch) -> Iterator[ScoreResult]:
        import torch

        for wid, toks in windows:
            t0 = time.perf_counter()
            ids = torch.tensor([toks], device=self.device)
            cache = kv_cache(fmt.name, self.model)
            logits = torch.cat(self._prefill(ids, cache, chunk, watch, f"for kv dtype {fmt.name}, window {wid}"),
                               dim=1)[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])
            yield ScoreResult(wid, float(-lp.sum()), int(ids.shape[-1] - 1), time.perf_counter() - t0)

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class VLLMConfig:
    model: str
    tp: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = True
    seed: int = 0
    timeout_s: float = 1800.0
    log_dir: str | None = None
    extra: dict = field(default_factory=dict)
    share: int = 1  # engines side by side on the GPU: each takes 1/share of the memory fraction


class VLLMEngine:
    """One `python -m kvarn.engines.vllm_worker` subprocess per kv dtype; results stream back line by line."""

    name = "vllm"

    def __init__(self, cfg: VLLMConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer

    def _llm_args(self, fmt: KVFormat, chunk: int | None, max_num_seqs: int | None) -> dict:
        c, more = self.cfg, {}
        if chunk:
            # vLLM requires max_num_batched_tokens >= max_num_seqs: a small prefill budget caps the batch too
            max_num_seqs = max_num_seqs or min(256, chunk)
            more = {"enable_chunked_prefill": True, "max_num_batched_tokens": max(chunk, max_num_seqs)}
        a = engine_kwargs(c.model, fmt.name, c.dtype, tp=c.tp, gpu_memory_utilization=c.gpu_memory_utilization,
                          seed=c.seed, max_model_len=c.max_model_len, max_num_seqs=max_num_seqs, extra=c.extra,
                          dtype=c.dtype, enforce_eager=c.enforce_eager, **more)
        if self.cfg.share > 1:
            a["gpu_memory_utilization"] = round(float(a["gpu_memory_utilization"]) / self.cfg.share, 3)
            total = gpus.gpu_total_bytes()
            if total and "kv_cache_memory_bytes" not in a:
                # engines side by side: vLLM's memory profiling reads the whole GPU's usage, which the other engines
                # change while they start and stop (a smaller cache, or its "Error in memory profiling" assert);
                # a KV cache sized up front (half of the engine's share) skips that profiling
                a["kv_cache_memory_bytes"] = int(total * a["gpu_memory_utilization"] / 2)
        return a

    def _run(self, fmt: KVFormat, job: dict) -> Iterator[dict]:
        import tempfile

        log_dir = Path(self.cfg.log_dir or tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        # unique per call: engines side by side (and evals sharing one --out) start in the same second
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        log = log_dir / f"vllm-{fmt.name}-{stamp}.log"
        jobf = log_dir / f"vllm-{fmt.name}-{stamp}.job.json"
        jobf.write_text(json.dumps(job))
        run = Launcher()
        lines = run.stream([sys.executable, "-m", "kvarn.engines.vllm_worker", str(jobf)], log, self.cfg.timeout_s,
                           env=child_env(), engine_args=job["llm"], until=DONE_TAG)
        # closing: a consumer that stops early ends the worker at once, not when the generator is collected
        with open(log, "ab", buffering=0) as logf, contextlib.closing(lines):  # other stdout lines beside stderr
            for line in lines:
                if line.startswith(RESULT_TAG):
                    yield json.loads(line[len(RESULT_TAG):])
                else:
                    logf.write(line.encode())
        res = run.result
        if res.done:  # every result arrived: how the process then ended does not change them
            return
        if res.timed_out:
            raise EngineError(f"vLLM run for {fmt.name} passed its {self.cfg.timeout_s:.0f} s limit (log: {log})",
                              "timeout")
        if res.returncode != 0:
            kind, line = res.failure()  # the exception, not the shutdown chatter that follows it in the log
            raise EngineError(f"vLLM exited {res.returncode} for {fmt.name}: {line[:300]} (log: {log})", kind)

    def generate(self, fmt: KVFormat, requests: list[GenRequest], params: GenParams) -> Iterator[GenResult]:
        job = {"mode": "generate", "llm": self._llm_args(fmt, params.chunk, None),
               "params": {"max_tokens": params.max_tokens, "temperature": params.temperature,
                          "top_p": params.top_p, "stop": list(params.stop)},
               "requests": [{"id": r.id, "k": r.k, "ids": r.prompt_ids, "seed": r.seed} for r in requests]}
        for d in self._run(fmt, job):
            yield GenResult(d["id"], d["k"], d["text"], d["gen_tokens"], d["finish_reason"] == "length",
                            d["finish_reason"], d["prompt_tokens"], d.get("seconds", 0.0))

    def score(self, fmt: KVFormat, windows: list[tuple[str, list[int]]], chunk: int) -> Iterator[ScoreResult]:
        # one sequence at a time with a `chunk`-token budget: every chunk attends to the quantized earlier ones
        job = {"mode": "score", "llm": self._llm_args(fmt, chunk, 1),
               "requests": [{"id": w, "ids": t} for w, t in windows]}
        for d in self._run(fmt, job):
            yield ScoreResult(d["id"], d["nll_sum"], d["tokens"], d.get("seconds", 0.0))

    def close(self):
        pass
