"""vLLM 0.26 engine arguments for a KV format: `LLM(**kwargs)` and the same as `vllm serve` flags.

format_args is the one place that knows what a format needs from vLLM (FP8 a bfloat16 model for FA3, KVarN presets
block_size = their tile); engine_kwargs, on which bench's cells (llm_kwargs) and eval's jobs build, and lm-eval's
model_args all take it from there.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..formats import get_format


def model_dir_for(model_path: str, workdir: str | Path) -> str:
    """A folder vLLM can load: bundled shapes are a bare config.json, copied into `workdir/model/`."""
    p = Path(model_path)
    if p.is_file() and p.suffix == ".json":
        d = Path(workdir) / "model"
        d.mkdir(parents=True, exist_ok=True)
        cfg = json.loads(p.read_text())
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        return str(d)
    return str(p)


def resolved_dtype(kv_dtype: str, model_dtype: str | None) -> str | None:
    """Model dtype the engine runs with: explicit, else bfloat16 for FP8 KV (FA3 rejects fp8 KV + fp16 output);
    None (or "auto"): vLLM's default."""
    if model_dtype and model_dtype != "auto":
        return model_dtype
    return "bfloat16" if get_format(kv_dtype).family == "fp8" else None


def format_args(kv_dtype: str, model_dtype: str | None = None) -> dict:
    """The `vllm.LLM` arguments a KV format sets: kv_cache_dtype, block_size for KVarN presets (a vLLM block is one
    tile), and the model dtype when one is needed or given (resolved_dtype)."""
    fmt = get_format(kv_dtype)
    kw: dict = {"kv_cache_dtype": fmt.name}
    if fmt.block_size:
        kw["block_size"] = fmt.block_size
    dtype = resolved_dtype(fmt.name, model_dtype)
    if dtype:
        kw["dtype"] = dtype
    return kw


def engine_kwargs(model: str, kv_dtype: str, model_dtype: str | None = None, tp: int = 1,
                  gpu_memory_utilization: float = 0.9, seed: int = 0, max_model_len: int | None = None,
                  max_num_seqs: int | None = None, extra: dict | str | None = None, **more) -> dict:
    """`vllm.LLM` keyword arguments as bench's cells and eval's jobs build them: the model, its parallelism, memory
    fraction and seed, the engine's own settings (`more`), what the KV format needs (format_args), then the user's
    pass-through `extra` (a dict or its JSON), which wins."""
    kw: dict = {"model": model, "tensor_parallel_size": int(tp), "gpu_memory_utilization": float(gpu_memory_utilization),
                "seed": int(seed)}
    if max_model_len:
        kw["max_model_len"] = int(max_model_len)
    kw.update(more)
    if max_num_seqs:
        kw["max_num_seqs"] = int(max_num_seqs)
    kw.update(format_args(kv_dtype, model_dtype))
    if isinstance(extra, str):
        extra = json.loads(extra)
    kw.update(extra or {})
    return kw


def llm_kwargs(cfg: dict, model_dir: str) -> dict:
    """`vllm.LLM` keyword arguments for a configuration (a BenchConfig as dict, e.g. dataclasses.asdict)."""
    more: dict = {"disable_log_stats": False}  # get_metrics(): preemptions, running requests, KV usage
    if cfg.get("dummy_weights"):
        more.update(load_format="dummy", skip_tokenizer_init=True)
    return engine_kwargs(model_dir, cfg["kv_dtype"], cfg.get("model_dtype"), tp=cfg.get("tp", 1),
                         gpu_memory_utilization=cfg.get("gpu_memory_utilization", 0.9), seed=cfg.get("seed", 0),
                         max_model_len=int(cfg["burst"]), max_num_seqs=cfg.get("max_num_seqs"),
                         extra=cfg.get("engine_args"), **more)


def serve_argv(kwargs: dict, host: str, port: int) -> list[str]:
    """`vllm serve MODEL ...` flags for the same kwargs (stats stay on: the server logs them by default)."""
    kw = dict(kwargs)
    argv = ["serve", str(kw.pop("model")), "--host", host, "--port", str(port)]
    kw.pop("disable_log_stats", None)
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is False:
            argv.append("--no-" + k.replace("_", "-"))
        elif v is None:
            continue
        elif isinstance(v, (dict, list)):
            argv += [flag, json.dumps(v)]
        else:
            argv += [flag, str(v)]
    return argv
