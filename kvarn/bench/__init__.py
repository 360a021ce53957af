"""`kvarn bench`: vLLM (or transformers) across KV formats, bursts and TP sizes into the results store.

plan.build_plan(BenchOptions) validates everything and lists the cells; runner.run_plan runs them through one
engine (engines.base.Engine: "vllm" = a fresh worker process per cell, "hf" = transformers) and appends one row
per (configuration, repeat) as soon as it ends; view renders the plan, the live progress and the summary.
"""
from .config import BenchConfig, Cell
from .engines import ENGINES, Engine, EngineResult, get_engine, register_engine
from .plan import DEFAULT_KV_DTYPES, DEFAULT_MODEL, BenchOptions, BenchPlan, build_plan

__all__ = ["BenchConfig", "BenchOptions", "Cell", "DEFAULT_KV_DTYPES", "DEFAULT_MODEL", "ENGINES", "Engine",
           "EngineResult", "BenchPlan", "build_plan", "get_engine", "register_engine"]
