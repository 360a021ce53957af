"""The vllm engine: every configuration x repeat in its own worker process (a fresh engine, a new process group).

Timeouts kill the whole group and any leftover GPU process of ours, so the next engine finds the memory free;
crashes and OOMs come back as rows with the log's error line. vLLM is never imported in this process.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ...engines import gpus
from ...engines.launch import Launcher, child_env
from ...engines.vllm_args import resolved_dtype
from ...errors import KvarnError
from ...formats import get_format
from ...shapes import resolve_model
from ..config import BenchConfig, Cell
from ..jit_log import midrun_compiles, start_costs
from ..progress import describe, read_progress, row_metrics
from .base import Engine, EngineResult, register_engine

DEFAULT_TIMEOUT_S = 1800.0  # the first TurboQuant start compiles Triton kernels for minutes


# what vLLM 0.26's OpenAI server imports beyond the offline engine's needs (its `vllm[...]`-less install, e.g. the
# device bundle, can lack them): checked before any serve cell starts
SERVE_MODULES = ("uvicorn", "fastapi", "model_hosting_container_standards", "jmespath")


@register_engine("vllm")
class VllmEngine(Engine):
    name = "vllm"
    modes = ("offline", "serve")
    default_timeout_s = DEFAULT_TIMEOUT_S

    def __init__(self):
        self.runner = Launcher()

    def check(self, configs: list[BenchConfig]) -> None:
        super().check(configs)
        if not gpus.vllm_available():
            raise KvarnError("--engine vllm needs vLLM 0.26 (pip install 'kvarn[vllm]'); use --engine hf to run without it")
        visible = gpus.visible_gpus()
        if not visible:
            raise KvarnError("--engine vllm needs a CUDA GPU and none is visible; use --engine hf on this machine")
        if any(c.mode == "serve" for c in configs):
            missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
            if missing:  # else every serve cell would start an engine only to fail at the server's imports
                raise KvarnError(f"--mode serve runs `vllm serve`, whose API server imports {', '.join(missing)}, "
                                 f"not installed here: pip install {' '.join(m.replace('_', '-') for m in missing)}; "
                                 "or --mode offline")
        for c in configs:
            extra = c.engine_arg_dict()
            pp = int(extra.get("pipeline_parallel_size", 1) or 1)
            # with Ray the engine's workers spread over the cluster's nodes: this host's GPUs are no bound
            if str(extra.get("distributed_executor_backend", "")).lower() != "ray" and c.tp * pp > len(visible):
                need = f"--tp {c.tp}" + (f" x pipeline_parallel_size {pp}" if pp > 1 else "")
                raise KvarnError(f"{need} needs {c.tp * pp} GPUs but {len(visible)} are visible "
                                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                                 f"accepted: 1..{len(visible)}, or --distributed-executor-backend ray on a Ray cluster")
            fmt = get_format(c.kv_dtype)
            dtype = resolved_dtype(c.kv_dtype, c.model_dtype)
            if dtype == "bfloat16" or fmt.family == "fp8":
                low = [g for g in visible if _cap(g["capability"]) < 8.0]
                if low:
                    raise KvarnError(f"kv dtype {c.kv_dtype} needs a bfloat16 model, which {low[0]['name']} "
                                     f"(compute {low[0]['capability']}) does not run; drop {c.kv_dtype} from --kv-dtype")
            if fmt.family == "kvarn" and importlib.util.find_spec("kvarn.vllm_plugin") is None:
                raise KvarnError(f"kv dtype {c.kv_dtype} needs the kvarn vLLM plugin (kvarn.vllm_plugin), not installed")

    def run(self, cell: Cell, timeout_s: float) -> EngineResult:
        log = Path(cell.log_path)
        work = log.parent / f"{log.stem}.work"
        work.mkdir(parents=True, exist_ok=True)
        spec = asdict(cell.config)
        spec.update(workdir=str(work), log_path=str(log), repeat=cell.repeat, start_timeout_s=timeout_s,
                    vocab_size=_vocab(cell.config))
        spec_path, result_path = work / "spec.json", work / "result.json"
        spec_path.write_text(json.dumps(spec, indent=1, default=str))
        result_path.unlink(missing_ok=True)
        (work / "progress.json").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "kvarn.engines.vllm_worker", str(spec_path), str(result_path)]
        # every Triton compile in the cell's log with its time and duration: a stall in the burst is matched to one
        env = child_env(defaults={"KVARN_LOG_COMPILES": "1"})
        # the user's engine arguments win, as in vLLM's: they set the memory fraction and ranks waited for
        c = cell.config
        engine_args = {"tensor_parallel_size": c.tp, "gpu_memory_utilization": c.gpu_memory_utilization,
                       **c.engine_arg_dict()}
        res = self.runner.run(cmd, log, timeout_s, env=env, engine_args=engine_args)
        try:
            text = log.read_text(errors="replace") if log.is_file() else ""
            out = self._result(res, work, result_path, timeout_s)
            # kernels that compiled during the timed burst (a stall of every running request), from the cell's log
            jit = midrun_compiles(text)
            if jit:
                out.metrics = {**out.metrics, "jit_compiles": jit["jit_compiles"],
                               "jit_compile_s": jit["jit_compile_s"]}
                out.info = {**out.info, "jit_kernels": jit["jit_kernels"]}
            # what the engine start paid for (compiles, graph capture, the plugin's warm-up)
            out.metrics = {**out.metrics, **start_costs(text)}
            return out
        finally:
            shutil.rmtree(work / "model", ignore_errors=True)

    @staticmethod
    def _result(res, work: Path, result_path: Path, timeout_s: float) -> EngineResult:
        if res.timed_out:  # what the worker reached (capacity, requests done) still goes into the row
            prog = read_progress(work)
            where = describe(prog, now=time.time())
            return EngineResult("timeout", f"no result after {timeout_s:.0f} s; process group killed "
                                           f"({len(res.killed_pids)} processes)" + (f"; {where}" if where else ""),
                                {**row_metrics(prog), "wall_s": res.elapsed_s})
        if result_path.is_file():
            data = json.loads(result_path.read_text())
            return EngineResult(data["status"], data.get("error", ""), data.get("metrics", {}), data.get("info", {}))
        kind, line = res.failure()
        return EngineResult(kind, f"worker exit {res.returncode}: {line}")

    def interrupt(self) -> None:
        self.runner.stop()


def _cap(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 9.0


def _vocab(c: BenchConfig) -> int:
    try:
        return resolve_model(c.model_path).vocab_size
    except (KvarnError, KeyError, ValueError):
        return 32000
