"""lm-eval bridge: `kvarn eval --harness lm-eval --tasks gsm8k,aime25 --kv-dtype ...` runs lm-eval's vLLM backend
once per kv dtype (each in its own subprocess, so GPU memory is released between engines), with
`model_args={"pretrained": ..., "kv_cache_dtype": NAME, "block_size": TILE, ...}` (the kvarn vLLM plugin makes
KVarN names valid), and stores lm-eval's metrics plus per-document scores in the one results store, with the same
paired statistics against the fp16 cache as the built-in tasks.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
import uuid
from pathlib import Path

import pandas as pd

from ..engines.launch import Launcher, child_env
from ..engines.vllm_args import format_args
from ..errors import KvarnError
from ..formats import KVFormat, parse_formats
from ..results import ResultsStore, config_hash
from ..shapes import model_label
from . import stats as S
from .engines import parse_kv_args
from .runner import Reporter, with_baseline

PREFERRED = ("exact_match,strict-match", "exact_match,none", "acc,none", "acc_norm,none",
             "exact_match,flexible-extract", "word_perplexity,none")


def model_args(src: str, fmt: KVFormat, tp: int, seed: int, extra: dict | None = None) -> dict:
    """lm-eval's vLLM model_args for a KV format: what the format needs (vllm_args.format_args, after the engine's
    settings, in the order the results store them), then the user's `extra`, which wins."""
    a = {"pretrained": src, "kv_cache_dtype": fmt.name, "tensor_parallel_size": tp, "seed": seed,
         "gpu_memory_utilization": 0.85}
    a.update(format_args(fmt.name))
    a.update(extra or {})
    return a


def primary_metric(metrics: dict) -> str | None:
    keys = [k for k in metrics if "," in k and "_stderr" not in k and isinstance(metrics[k], (int, float))]
    for p in PREFERRED:
        if p in keys:
            return p
    return keys[0] if keys else None


def _worker_cmd(job: Path) -> list[str]:
    return [sys.executable, "-m", "kvarn.eval.harness", str(job)]


def run_harness(tasks: list[str], kv_dtypes: str | None, model: str, weights: str | None, tp: int = 1,
                limit: int | None = None, seed: int = 0, out: str = "results", chat: bool = False,
                fewshot: int | None = None, gen_kwargs: str | None = None, extra_model_args: str | None = None,
                timeout_min: float = 120.0, reporter: Reporter | None = None) -> list[dict]:
    rep = reporter or Reporter()
    if not tasks:
        raise KvarnError("--harness lm-eval needs --tasks t1,t2 (lm-eval task names)")
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise KvarnError("--harness lm-eval needs lm-eval: pip install 'kvarn[eval]' (lm-eval>=0.4.13)")
    formats, base = with_baseline(parse_formats(kv_dtypes or "auto"))
    src = weights or model
    store = ResultsStore(out)
    run_id = uuid.uuid4().hex[:12]
    extra = parse_kv_args(extra_model_args)
    per_fmt: dict[str, dict] = {}
    log_dir = Path(out) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        margs = model_args(src, fmt, tp, seed, extra)
        job = {"model_args": margs, "tasks": tasks, "limit": limit, "seed": seed, "chat": chat, "fewshot": fewshot,
               "gen_kwargs": gen_kwargs}
        rep.info(f"lm-eval {','.join(tasks)} with kv_cache_dtype={fmt.name}")
        with tempfile.TemporaryDirectory() as td:
            jf, rf = Path(td) / "job.json", Path(td) / "result.json"
            job["result"] = str(rf)
            jf.write_text(json.dumps(job))
            log = log_dir / f"lm-eval-{fmt.name}-{run_id}.log"
            status, error, res = "ok", "", None
            # a session of its own: a timeout ends lm-eval and the vLLM engine core it started, freeing the GPU
            r = Launcher().run(_worker_cmd(jf), log, timeout_min * 60, env=child_env(), engine_args=margs)
            if r.timed_out:
                status, error = "timeout", f"lm-eval passed its {timeout_min:g} min limit (log: {log})"
            elif r.returncode != 0 or not rf.is_file():
                status, line = r.failure()
                error = f"lm-eval exited {r.returncode}: {line[:300]} (log: {log})"
            else:
                res = json.loads(rf.read_text())
        if status != "ok":
            rep.info(f"{fmt.name}: {status}: {error}")
        per_fmt[fmt.name] = {"fmt": fmt, "res": res, "status": status, "error": error, "margs": margs}

    rows_s, rows_e = [], []
    label = model_label(model)  # the rows' model column, as bench writes it (resolved once, not per row)
    for t in tasks:
        task_name = f"lm-eval:{t}"
        docs: dict[str, dict[str, float]] = {}
        for name, d in per_fmt.items():
            cfg = {"harness": "lm-eval", "task": t, "model": model, "weights": weights, "kv_dtype": name, "tp": tp,
                   "seed": seed, "limit": limit, "chat": chat, "fewshot": fewshot, "gen_kwargs": gen_kwargs,
                   "extra": extra}
            row = {"kind": "eval", "run_id": run_id, "config_hash": config_hash(cfg), "model": label,
                   "kv_dtype": name, "engine": "vllm", "tp": tp, "task": task_name, "seed": seed, "status": d["status"],
                   "error": d["error"], "harness": "lm-eval", "baseline_kv_dtype": base.name,
                   "lm_eval_model_args": json.dumps(d["margs"])}
            res = d["res"]
            if res is not None:
                metrics = res.get("results", {}).get(t)
                if metrics is None:
                    row.update(status="failed", error=f"lm-eval returned no results for task {t!r}")
                else:
                    pm = primary_metric(metrics)
                    # perplexity tasks (wikitext: word_perplexity, ...) are ppl rows, not accuracies
                    is_ppl = bool(pm) and "perplexity" in pm
                    row["metric"] = "ppl" if is_ppl else "accuracy"
                    row["lm_eval_metric"] = pm
                    row["lm_eval_value"] = float(metrics[pm]) if pm else math.nan
                    se = metrics.get(pm.replace(",", "_stderr,")) if pm else None
                    row["lm_eval_stderr"] = float(se) if isinstance(se, (int, float)) else math.nan
                    row["lm_eval_version"] = res.get("lm_eval_version")
                    per_doc = {} if is_ppl else _doc_scores(res.get("samples", {}).get(t, []), pm)
                    docs[name] = per_doc
                    for did, v in per_doc.items():
                        rows_s.append({"kind": "sample", "run_id": run_id, "config_hash": row["config_hash"],
                                       "model": label, "kv_dtype": name, "engine": "vllm", "tp": tp,
                                       "task": task_name, "seed": seed, "status": "ok", "repeat": 0,
                                       "sample_id": did, "correct": v})
                    if per_doc:
                        a = S.summarize_accuracy({k: [v] for k, v in per_doc.items()})
                        binary = all(v in (0.0, 1.0) for v in per_doc.values())
                        if not binary:
                            a.ci_low, a.ci_high = S.bootstrap_mean(list(per_doc.values()))
                        row.update(n=float(a.n), accuracy=a.accuracy, ci_low=a.ci_low, ci_high=a.ci_high,
                                   ci_method=a.method if binary else "bootstrap")
                    elif pm:
                        v, s_ = row["lm_eval_value"], row["lm_eval_stderr"]
                        n = res.get("n-samples", {}).get(t, {}).get("effective")
                        row.update({"n": float(n) if n else math.nan, "ppl" if is_ppl else "accuracy": v,
                                    "ci_method": "lm-eval stderr",
                                    "ci_low": v - S.Z95 * s_ if not math.isnan(s_) else math.nan,
                                    "ci_high": v + S.Z95 * s_ if not math.isnan(s_) else math.nan})
            rows_e.append(row)
        for row in rows_e:
            if row["task"] != task_name:
                continue
            name = row["kv_dtype"]
            if name == base.name:  # a failed baseline has no difference to itself either
                z = 0.0 if row.get("status") == "ok" else math.nan
                row.update(delta_vs_fp16=z, delta_ci_low=z, delta_ci_high=z)
            elif row.get("metric") == "ppl":  # lm-eval gives no per-window losses: the difference, no paired interval
                b = next((r for r in rows_e if r["task"] == task_name and r["kv_dtype"] == base.name), None)
                if b is not None and b.get("ppl") is not None and row.get("ppl") is not None:
                    row.update(delta_vs_fp16=row["ppl"] - b["ppl"], ppl_rise_pct=(row["ppl"] / b["ppl"] - 1) * 100)
            elif name in docs and base.name in docs and docs[name] and docs[base.name]:
                pd_ = S.paired_accuracy({k: [v] for k, v in docs[name].items()},
                                        {k: [v] for k, v in docs[base.name].items()}, seed=seed)
                row.update(delta_vs_fp16=pd_.delta, delta_ci_low=pd_.ci_low, delta_ci_high=pd_.ci_high,
                           n_paired=pd_.n_paired, mcnemar_p=pd_.mcnemar_p)
    if rows_s:
        store.append(rows_s, kind="sample")
    store.append(rows_e, kind="eval")
    return rows_e


def _doc_scores(samples: list[dict], pm: str | None) -> dict[str, float]:
    if not pm:
        return {}
    metric, _, filt = pm.partition(",")
    out: dict[str, float] = {}
    for s in samples:
        if s.get("filter", filt) != filt or metric not in s:
            continue
        v = s[metric]
        if isinstance(v, (int, float, bool)):
            out[str(s.get("doc_id"))] = float(v)
    return out


# ---- worker (subprocess) ---------------------------------------------------------------------------------------------
def _worker(path: str) -> int:
    job = json.loads(Path(path).read_text())
    import lm_eval

    kw = dict(model="vllm", model_args=job["model_args"], tasks=job["tasks"], limit=job["limit"], log_samples=True,
              random_seed=job["seed"], numpy_random_seed=job["seed"], torch_random_seed=job["seed"],
              fewshot_random_seed=job["seed"], apply_chat_template=bool(job["chat"]))
    if job.get("fewshot") is not None:
        kw["num_fewshot"] = job["fewshot"]
    if job.get("gen_kwargs"):
        kw["gen_kwargs"] = job["gen_kwargs"]
    res = lm_eval.simple_evaluate(**kw)
    if res is None:
        raise SystemExit("lm-eval returned no results")
    slim = {}
    for t, samples in (res.get("samples") or {}).items():
        keep = []
        for s in samples:
            keep.append({k: v for k, v in s.items()
                         if k in ("doc_id", "filter") or isinstance(v, (int, float, bool)) and not isinstance(v, str)})
        slim[t] = keep
    out = {"results": res.get("results", {}), "samples": slim, "n-samples": res.get("n-samples", {}),
           "lm_eval_version": getattr(lm_eval, "__version__", None)}
    Path(job["result"]).write_text(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
