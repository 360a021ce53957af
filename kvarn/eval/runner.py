"""`kvarn eval` driver: build prompts once, run every kv dtype on the same prompts and seeds, stream per-sample rows
into the results store as they finish (resumable), then write one summary row per kv dtype with its interval and
the paired change vs the fp16 baseline.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .. import settings
from ..errors import KvarnError
from ..formats import KVFormat, get_format, parse_formats
from ..results import ResultsStore, config_hash
from ..shapes import model_label
from . import stats as S
from .data import file_digest
from .engines import EngineError, GenParams, GenRequest, model_source, pick_engine
from .tasks import LM_EVAL_FEWSHOT_SEED, Item, LoadOptions, TaskSpec, get_task

DEFAULT_CONTEXT = {"niah": (2048,), "ppl": (1024,)}
DEFAULT_CHUNK = {"ppl": 128, "niah": 512}


@dataclass
class EvalOptions:
    task: str
    model: str = "smollm2-135m"
    weights: str | None = None
    kv_dtypes: str | None = None
    engine: str = "auto"
    tp: int = 1
    limit: int | None = None
    samples: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    context: str | None = None
    chat: bool | None = None  # None: the task's protocol (TaskSpec.chat)
    thinking: bool | None = None
    data: str | None = None
    seed: int = 0
    out: str = "results"
    chunk: int | None = None
    fewshot: int | None = None
    needle: str = "kv"
    depth: str | None = None  # niah needle depths, e.g. "0,0.5,1" (default: --limit evenly spaced)
    resume: bool = True
    timeout_min: float = 60.0
    bootstrap_seed: int = 0
    model_args: str | None = None  # vLLM engine arguments k=v,... (as lm-eval's --model_args), e.g. max_num_seqs=1
    concurrency: int = 1  # kv dtypes run side by side on one GPU (vLLM engine), each with 1/n of its memory
    dtype: str | None = None  # the model's dtype (kvarn.finite.DTYPES); None: the engine's default


class Reporter:
    """Progress hooks (the CLI draws a Rich bar with ETA); the default is silent."""

    def info(self, msg: str) -> None:
        pass

    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def stop(self) -> None:
        pass


class _QuietReporter(Reporter):
    """For formats running side by side: one line when each starts and ends instead of interleaved bars."""

    def __init__(self, inner: Reporter):
        self.inner, self.lock = inner, threading.Lock()

    def info(self, msg: str) -> None:
        with self.lock:
            self.inner.info(msg)

    def start(self, label: str, total: int) -> None:
        self.info(f"{label}: {total} to run")


@dataclass
class Plan:
    spec: TaskSpec
    formats: list[KVFormat]
    baseline: KVFormat
    engine: str
    engine_why: str
    params: GenParams | None
    contexts: tuple[int, ...]
    chunk: int | None
    protocol: dict = field(default_factory=dict)
    depths: tuple[float, ...] = ()  # niah needle depths given with --depth
    engine_args: dict = field(default_factory=dict)  # --model-args, passed to vllm.LLM


def with_baseline(formats: list[KVFormat]) -> tuple[list[KVFormat], KVFormat]:
    """The fp16 baseline first (added as `auto` when none of the list is 16-bit), then the others in order."""
    base = next((f for f in formats if f.family == "fp16"), None) or get_format("auto")
    return [base] + [f for f in formats if f is not base], base


def _seed_for(seed: int, task: str, pid: str, k: int) -> int:
    h = hashlib.sha256(f"{seed}|{task}|{pid}|{k}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def plan(o: EvalOptions) -> Plan:
    from ..finite import parse_dtype

    o.dtype = parse_dtype(o.dtype)
    spec = get_task(o.task)
    if o.samples is None or o.samples < 1:
        raise KvarnError(f"--samples must be >= 1 (answers per problem), got {o.samples}")
    if spec.kind == "ppl" and o.samples != 1:
        raise KvarnError("--samples applies to generation tasks; ppl is deterministic (use --samples 1)")
    if o.limit is not None and o.limit < 1:
        raise KvarnError(f"--limit must be >= 1, got {o.limit}")
    if o.tp < 1:
        raise KvarnError(f"--tp must be >= 1, got {o.tp}")
    if o.concurrency < 1:
        raise KvarnError(f"--concurrency must be >= 1 (kv dtypes run side by side), got {o.concurrency}")
    if o.chunk is not None and o.chunk < 1:
        raise KvarnError(f"--chunk must be >= 1 token, got {o.chunk}")
    if o.max_tokens is not None and o.max_tokens < 1:
        raise KvarnError(f"--max-tokens must be >= 1, got {o.max_tokens}")
    if o.needle not in ("kv", "passkey"):
        raise KvarnError(f"unknown --needle {o.needle!r}; accepted: kv, passkey")
    if o.data and not Path(o.data).expanduser().is_file():
        raise KvarnError(f"--data file not found: {o.data}")
    temp = o.temperature if o.temperature is not None else (0.0 if o.samples == 1 else 0.6)
    top_p = o.top_p if o.top_p is not None else (1.0 if temp == 0 else 0.95)
    if temp < 0 or not (0 < top_p <= 1):
        raise KvarnError(f"need --temperature >= 0 and 0 < --top-p <= 1, got {temp} and {top_p}")
    if o.samples > 1 and temp == 0:
        raise KvarnError(f"--samples {o.samples} with --temperature 0 gives {o.samples} identical greedy answers; "
                         "give --temperature > 0 (e.g. 0.6) or --samples 1")
    if o.chat is None:
        o.chat = spec.chat
    if o.thinking is not None and not o.chat:
        raise KvarnError("--thinking / --no-thinking switch the chat template's enable_thinking; add --chat")
    from .tasks import parse_contexts, parse_depths

    contexts = parse_contexts(o.context, DEFAULT_CONTEXT.get(spec.name, ()))
    depths = parse_depths(o.depth)
    if depths and spec.name != "niah":
        raise KvarnError("--depth places the niah needle; other tasks have none")
    if spec.kind == "ppl" and len(contexts) != 1:
        raise KvarnError("ppl takes one --context (the window in tokens), e.g. --context 1024")
    formats, base = with_baseline(parse_formats(o.kv_dtypes or "auto"))
    engine, why = pick_engine(o.engine)
    if engine == "vllm":  # before any engine starts (the transformers engine runs fp8 in any model dtype)
        for f in formats:
            f.check_model_dtype(o.dtype)
    from .engines import parse_kv_args

    engine_args = parse_kv_args(o.model_args)
    if engine_args and engine != "vllm":
        raise KvarnError(f"--model-args are vLLM engine arguments; this run uses --engine {engine}")
    chunk = o.chunk if o.chunk is not None else DEFAULT_CHUNK.get(spec.name)
    params = None
    if spec.kind == "generate":
        params = GenParams(max_tokens=o.max_tokens or spec.max_tokens, temperature=temp, top_p=top_p,
                           stop=spec.stop, chunk=chunk)
    protocol = {"max_tokens": params.max_tokens if params else None, "temperature": temp if params else None,
                "top_p": top_p if params else None, "chat": bool(o.chat), "thinking": o.thinking,
                "fewshot": (spec.fewshot if o.fewshot is None else o.fewshot) if spec.name == "gsm8k" else 0,
                "chunk": chunk, "context": ",".join(map(str, contexts)) or None,
                "needle": o.needle if spec.name == "niah" else None, "lm_eval_task": spec.lm_eval or None}
    if depths:  # niah with chosen depths: other prompts than the default spacing (hashed only when given)
        protocol["depths"] = ",".join(f"{d:g}" for d in depths)
    if engine_args:  # engine settings that change what attention reads (prefix caching, batching): hashed when given
        protocol["engine_args"] = json.dumps(engine_args, sort_keys=True)
    if o.dtype:  # a chosen model dtype is other numbers than the default's: hashed only when given
        protocol["dtype"] = o.dtype
    if protocol["fewshot"]:  # gsm8k's shots are lm-eval's draw (tasks.load_gsm8k); older runs drew per problem
        protocol["fewshot_sampler"] = f"lm-eval:{LM_EVAL_FEWSHOT_SEED}"
    return Plan(spec, formats, base, engine, why, params, contexts, chunk, protocol, depths, engine_args)


def _prompt_ids(tok, prompt: str, chat: bool, thinking: bool | None) -> list[int]:
    if chat:
        if not getattr(tok, "chat_template", None):
            raise KvarnError("--chat: this tokenizer has no chat template; use --no-chat")
        kw = {} if thinking is None else {"enable_thinking": thinking}
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True, **kw)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(prompt)["input_ids"]


# ---- store helpers ---------------------------------------------------------------------------------------------------
def _done_samples(store: ResultsStore, chash: str) -> pd.DataFrame:
    df = store.read("sample")
    if df.empty or "config_hash" not in df.columns:
        return pd.DataFrame()
    df = df[(df["config_hash"] == chash) & (df["status"] == "ok")]
    if df.empty:
        return df
    df = df.sort_values("created_at").drop_duplicates(["sample_id", "repeat"], keep="last")
    return df.reset_index(drop=True)


class _Flusher:
    """Each finished problem is on disk before the next one is scored (its own part: a kill, SIGTERM included,
    loses at most the problems in flight); at the end the format's parts are merged into one."""

    def __init__(self, store: ResultsStore):
        self.store, self.parts = store, []

    def add(self, row: dict) -> None:
        part = self.store.append(row, kind="sample")
        if part is not None:
            self.parts.append(part)

    def flush(self) -> None:
        self.store.merge(self.parts, kind="sample")
        self.parts = []


# ---- main ------------------------------------------------------------------------------------------------------------
def run_eval(o: EvalOptions, reporter: Reporter | None = None, engine_obj=None) -> list[dict]:
    """Run one task over every kv dtype; returns the summary rows written (kind="eval")."""
    rep = reporter or Reporter()
    p = plan(o)
    spec = p.spec
    rep.info(f"engine: {p.engine} ({p.engine_why})")
    store = ResultsStore(o.out)
    run_id = uuid.uuid4().hex[:12]

    # data first when it needs no tokenizer: a missing file or an unreachable hub fails before a model loads
    lopts = LoadOptions(data=o.data, limit=o.limit, seed=o.seed, fewshot=o.fewshot, contexts=p.contexts,
                        needle=o.needle, depths=p.depths, window=p.contexts[0] if spec.kind == "ppl" else None,
                        reserve=p.params.max_tokens if spec.name == "niah" else 0)
    items, source = (None, None) if spec.needs_tokenizer else spec.loader(lopts, None)
    if items is not None and not items:
        raise KvarnError(f"{spec.name}: no problems to run (empty data)")

    eng = engine_obj or _make_engine(p, o)
    tok = eng.tokenizer
    if items is None:
        items, source = spec.loader(lopts, tok)
    data_sig = {"source": source, "digest": file_digest(o.data) if o.data else None,
                "n_per_context": (len(p.depths) or o.limit or 10) if spec.name == "niah" else None}
    k = o.samples
    if spec.kind == "generate":
        prompts = {it.id: _prompt_ids(tok, it.prompt, o.chat, o.thinking) for it in items}
        rep.info(f"{spec.name}: {len(items)} problems x {k} sample(s) from {source}; prompt tokens "
                 f"{min(map(len, prompts.values()))}-{max(map(len, prompts.values()))}; "
                 f"max {p.params.max_tokens} new tokens, T={p.params.temperature}, top_p={p.params.top_p}, "
                 f"{'chat' if o.chat else 'completion'} prompts")
        need = max(map(len, prompts.values())) + p.params.max_tokens
    else:
        prompts = {}
        need = p.contexts[0] + 1  # vLLM scores prompt log-probs of a request that generates one token
        rep.info(f"ppl: {len(items)} windows x {p.contexts[0]} tokens from {source}, fed in chunks of {p.chunk}")

    if hasattr(eng, "cfg") and getattr(eng.cfg, "max_model_len", 0) is None:
        cap = _model_max_len(model_source(o.model, o.weights))
        if cap and need > cap and spec.kind == "ppl":
            raise KvarnError(f"--context {p.contexts[0]}: a ppl window on vLLM needs one position more (its scoring "
                             f"request generates a token) and the model holds {cap}; use --context {cap - 1} or less")
        if cap and need > cap:
            rep.info(f"max_model_len capped at the model's {cap} tokens (prompt + --max-tokens wants {need}); "
                     "answers that reach it count as truncated")
        eng.cfg.max_model_len = min(need, cap) if cap else need
    summaries: list[dict] = []
    # what the rows record: the loaded model's dtype (hf), else the --dtype handed to vLLM
    model_dtype = getattr(eng, "dtype", None) if p.engine == "hf" else (o.dtype or "auto")
    label = model_label(o.model)  # the rows' model column, as bench writes it (the hash keeps --model: resume)
    # as bench's: a knob (or a moved default) is its own cell; those of speed alone do not change a score
    knobs = settings.result_env(scopes=("method", "backend") if p.engine == "vllm" else ("method",))
    def run_format(fmt: KVFormat) -> None:
        cfg = {"task": spec.name, "model": o.model, "weights": o.weights, "kv_dtype": fmt.name, "engine": p.engine,
               "tp": o.tp, "seed": o.seed, **p.protocol, "data": data_sig,
               **({"backend_env": knobs} if knobs and fmt.family == "kvarn" else {})}
        chash = config_hash(cfg)
        base_row = {"run_id": run_id, "config_hash": chash, "model": label, "kv_dtype": fmt.name,
                    "engine": p.engine, "tp": o.tp, "task": spec.name, "seed": o.seed, "model_dtype": model_dtype}
        done = _done_samples(store, chash) if o.resume else pd.DataFrame()
        done_keys = set(zip(done["sample_id"].astype(str), done["repeat"].astype(int))) if len(done) else set()
        want = [(it, j) for it in items for j in range(k)]
        todo = [(it, j) for it, j in want if (it.id, j) not in done_keys]
        if done_keys:
            rep.info(f"{fmt.name}: {len(want) - len(todo)} of {len(want)} samples already in {o.out}, skipped")
        flusher = _Flusher(store)
        new_rows: list[dict] = []
        status, error = "ok", ""
        by_id = {it.id: it for it in items}
        rep.start(f"{spec.name} {fmt.name}", len(todo))
        t0 = time.perf_counter()
        try:
            if todo and spec.kind == "generate":
                reqs = [GenRequest(it.id, j, prompts[it.id], _seed_for(o.seed, spec.name, it.id, j)) for it, j in todo]
                for r in eng.generate(fmt, reqs, p.params):
                    it = by_id[r.id]
                    sc = spec.scorer(it, _strip(r.text, o.thinking))
                    row = {**base_row, "kind": "sample", "status": "ok", "repeat": r.k, "sample_id": it.id,
                           "target": it.target, "response": r.text, "extracted": str(sc.pop("extracted")),
                           "correct": float(bool(sc.pop("correct"))), "gen_tokens": r.gen_tokens,
                           "truncated": bool(r.truncated), "finish_reason": r.finish_reason,
                           "prompt_tokens": r.prompt_tokens, "seconds": r.seconds, "sample_seed": _seed_for(
                               o.seed, spec.name, it.id, r.k)}
                    for key, val in sc.items():
                        row[key] = float(bool(val)) if key.startswith("correct") else str(val)
                    for key in ("context", "depth"):
                        if key in it.meta:
                            row[key] = it.meta[key]
                    flusher.add(row)
                    new_rows.append(row)
                    rep.advance()
            elif todo:
                wins = [(it.id, it.token_ids) for it, _ in todo]
                for r in eng.score(fmt, wins, p.chunk):
                    it = by_id[r.id]
                    if not math.isfinite(r.nll_sum):  # summing would skip it: a NaN never becomes a perplexity
                        raise EngineError(f"log-likelihood of window {it.id} is {r.nll_sum} (non-finite) for kv "
                                          f"dtype {fmt.name}: the model's activations overflow in its dtype; try "
                                          "--dtype bfloat16 or float32", "failed")
                    row = {**base_row, "kind": "sample", "status": "ok", "repeat": 0, "sample_id": it.id,
                           "nll_sum": r.nll_sum, "tokens": r.tokens, "ppl": math.exp(r.nll_sum / max(1, r.tokens)),
                           "offset": it.meta.get("offset"), "context": it.meta.get("window"), "seconds": r.seconds}
                    flusher.add(row)
                    new_rows.append(row)
                    rep.advance()
        except EngineError as e:
            status, error = e.status, str(e)
            rep.info(f"{fmt.name}: {e.status}: {e}")
        finally:
            flusher.flush()
            rep.stop()
        rows = pd.concat([done, pd.DataFrame(new_rows)], ignore_index=True) if len(done) else pd.DataFrame(new_rows)
        have = set(zip(rows["sample_id"].astype(str), rows["repeat"].astype(int))) if len(rows) else set()
        missing = sum(1 for it, j in want if (it.id, j) not in have)
        if status == "ok" and missing:
            status, error = "failed", f"{missing} of {len(want)} samples missing (engine returned fewer results)"
        done_formats[fmt.name] = {"fmt": fmt, "rows": rows, "base_row": base_row, "status": status, "error": error,
                                "seconds": time.perf_counter() - t0, "config": cfg}

    done_formats: dict[str, dict] = {}
    written: set[str] = set()
    lock = threading.Lock()

    def write_summaries() -> None:
        # each finished format's summary (paired against the baseline) goes to disk as soon as both exist: a run cut
        # later (a step's time limit, a stuck engine shutdown) keeps the summaries of every format it finished
        with lock:
            if p.baseline.name not in done_formats:
                return
            for f in p.formats:
                if f.name in written or f.name not in done_formats:
                    continue
                sub = {p.baseline.name: done_formats[p.baseline.name], f.name: done_formats[f.name]}
                s = summarize(spec, sub, p.baseline.name, items, k, seed=o.bootstrap_seed)[-1]
                s.update({"engine_why": p.engine_why, "data_source": source, "samples_k": k, **{
                    f"protocol_{key}": (json.dumps(v) if isinstance(v, (dict, list)) else v)
                    for key, v in p.protocol.items()}})
                _refuse_nonfinite(s, spec.kind)
                store.append([s], kind="eval")
                summaries.append(s)
                written.add(f.name)

    def run_and_summarize(fmt: KVFormat) -> None:
        run_format(fmt)
        write_summaries()

    if o.concurrency > 1 and p.engine == "vllm" and len(p.formats) > 1:
        # small models leave most of a GPU idle: one engine per kv dtype side by side, each a share of the memory
        n = min(o.concurrency, len(p.formats))
        if hasattr(eng, "cfg"):
            eng.cfg.share = n
        rep = _QuietReporter(rep)
        with ThreadPoolExecutor(max_workers=n) as ex:
            list(ex.map(run_and_summarize, p.formats))
    else:
        for fmt in p.formats:
            run_and_summarize(fmt)
    order = {f.name: i for i, f in enumerate(p.formats)}
    summaries.sort(key=lambda r: order[r["kv_dtype"]])
    try:
        eng.close()
    except Exception:  # noqa: BLE001
        pass
    return summaries


def _refuse_nonfinite(s: dict, kind: str) -> None:
    """A perplexity that came out inf / NaN (e.g. vLLM's prompt log-probs of an overflowing model) is a failed row,
    not a result."""
    if s.get("status") != "ok" or kind != "ppl":
        return
    v = s.get("ppl")
    if v is not None and not math.isfinite(float(v)):
        s.update(status="failed", error=f"perplexity of kv dtype {s.get('kv_dtype')} is {v} (non-finite): the "
                                        "model's activations overflow in its dtype; try --dtype bfloat16 or float32")


def _strip(text: str, thinking: bool | None) -> str:
    from .extract import strip_thinking

    return strip_thinking(text) if thinking is not False else text


_HF_ENGINES: dict = {}


def _model_max_len(src: str) -> int | None:
    try:
        from ..shapes import resolve_model

        return resolve_model(src).max_context
    except Exception:  # noqa: BLE001 - unknown shape: let vLLM decide
        return None


def _make_engine(p: Plan, o: EvalOptions):
    from .engines import HFEngine, VLLMConfig, VLLMEngine, load_tokenizer, model_source

    src = model_source(o.model, o.weights)
    if p.engine == "hf":
        if o.tp != 1:
            raise KvarnError("--engine hf runs on one device; --tp > 1 needs --engine vllm")
        key = (src, o.dtype)
        if key not in _HF_ENGINES:  # one load per process (suites and tests call eval repeatedly)
            _HF_ENGINES.clear()
            _HF_ENGINES[key] = HFEngine(src, dtype=o.dtype)
        return _HF_ENGINES[key]
    from ..shapes import bundled_models

    if src.lower() in bundled_models() and not Path(src).exists():
        from .. import models

        fix = f"install them with: {models.install_fix(src)}" if models.lookup(src) else \
            "give --weights DIR (a Hugging Face folder)"
        raise KvarnError(f"--engine vllm needs real weights for {src!r}: {fix}")
    tok = load_tokenizer(src)
    return VLLMEngine(VLLMConfig(model=src, tp=o.tp, seed=o.seed, timeout_s=o.timeout_min * 60,
                                 dtype=o.dtype or "auto",
                                 log_dir=str(Path(o.out) / "logs"), extra=dict(p.engine_args)), tok)


# ---- summaries -------------------------------------------------------------------------------------------------------
def _per_problem(rows: pd.DataFrame, ids: set[str], k: int, col: str = "correct") -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    if rows.empty or col not in rows.columns:
        return out
    r = rows[rows["sample_id"].astype(str).isin(ids) & (rows["repeat"].astype(int) < k)]
    for pid, g in r.groupby(r["sample_id"].astype(str)):
        out[pid] = [float(x) for x in g.sort_values("repeat")[col]]
    return out


def summarize(spec: TaskSpec, per_format: dict, baseline: str, items: list[Item], k: int, seed: int = 0) -> list[dict]:
    ids = {it.id for it in items}
    out = []
    base = per_format.get(baseline)
    for name, d in per_format.items():
        rows = d["rows"]
        s = {**d["base_row"], "kind": "eval", "repeat": 0, "status": d["status"], "error": d["error"],
             "seconds": d["seconds"], "baseline_kv_dtype": baseline}
        if spec.kind == "ppl":
            r = rows[rows["sample_id"].astype(str).isin(ids)] if len(rows) else rows
            s["metric"], s["ci_method"] = "ppl", "bootstrap over windows"
            s["n"] = int(len(r))
            if len(r):
                s["ppl"] = S.ppl_of(r["nll_sum"], r["tokens"])
                # one window has no spread to resample: no interval rather than a zero-width one
                s["ci_low"], s["ci_high"] = (S.bootstrap_ppl(r["nll_sum"], r["tokens"], seed=seed) if len(r) > 1
                                             else (math.nan, math.nan))
                s["scored_tokens"] = int(r["tokens"].sum())
            if base is not None and len(r) and len(base["rows"]):
                b = base["rows"]
                m = r.merge(b[["sample_id", "nll_sum", "tokens"]], on="sample_id", suffixes=("", "_b"))
                if len(m):
                    dlt, lo, hi = S.paired_bootstrap_ppl(m["nll_sum"], m["tokens"], m["nll_sum_b"], m["tokens_b"],
                                                          seed=seed)
                    if len(m) < 2:
                        lo = hi = math.nan
                    ref = S.ppl_of(m["nll_sum_b"], m["tokens_b"])
                    s.update(delta_vs_fp16=dlt, delta_ci_low=lo, delta_ci_high=hi, n_paired=int(len(m)),
                             ppl_rise_pct=dlt / ref * 100 if ref else math.nan)
        else:
            pp = _per_problem(rows, ids, k)
            a = S.summarize_accuracy(pp, seed=seed)
            s.update(metric="accuracy", n=a.n, accuracy=a.accuracy, ci_low=a.ci_low, ci_high=a.ci_high,
                     pass_at_k=a.pass_at_k, ci_method=a.method)
            for alt in spec.alternates:
                pa = _per_problem(rows, ids, k, f"correct_{alt}")
                if pa:
                    aa = S.summarize_accuracy(pa, seed=seed)
                    s.update({f"accuracy_{alt}": aa.accuracy, f"ci_low_{alt}": aa.ci_low, f"ci_high_{alt}": aa.ci_high})
            if len(rows):
                r = rows[rows["sample_id"].astype(str).isin(ids) & (rows["repeat"].astype(int) < k)]
                s["truncation_rate"] = float(r["truncated"].astype(bool).mean()) if len(r) else math.nan
                s["mean_gen_tokens"] = float(r["gen_tokens"].mean()) if len(r) else math.nan
                if "context" in r.columns and r["context"].notna().any():
                    by = {str(int(c)): float(g["correct"].mean()) for c, g in r.groupby("context")}
                    s["by_context"] = json.dumps(by)
                if "depth" in r.columns and r["depth"].notna().any():  # niah: where in the context the needle sat
                    by = {f"{float(d):.2f}": float(g["correct"].mean()) for d, g in r.groupby("depth")}
                    s["by_depth"] = json.dumps(by)
            if base is not None:
                pb = _per_problem(base["rows"], ids, k)
                pdiff = S.paired_accuracy(pp, pb, seed=seed)
                s.update(delta_vs_fp16=pdiff.delta, delta_ci_low=pdiff.ci_low, delta_ci_high=pdiff.ci_high, n_paired=pdiff.n_paired,
                         mcnemar_p=pdiff.mcnemar_p, only_candidate=pdiff.only_candidate,
                         only_baseline=pdiff.only_baseline)
        if name == baseline and s["status"] == "ok":
            s.update(delta_vs_fp16=0.0, delta_ci_low=0.0, delta_ci_high=0.0)
        elif name == baseline:  # a failed baseline has no difference to itself: unset (NaN), not a measured zero
            s.update(delta_vs_fp16=math.nan, delta_ci_low=math.nan, delta_ci_high=math.nan)
            for c in ("ppl_rise_pct", "n_paired", "mcnemar_p", "only_candidate", "only_baseline"):
                s.pop(c, None)
        for c in ("n", "ppl", "accuracy", "ci_low", "ci_high", "delta_vs_fp16", "delta_ci_low", "delta_ci_high",
                  "truncation_rate", "mean_gen_tokens"):
            if c in s and s[c] is not None:
                s[c] = float(s[c])
        out.append(s)
    return out
