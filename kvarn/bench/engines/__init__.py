"""Engines behind one interface (base.Engine): `vllm` (a fresh process per cell) and `hf` (transformers). Both
import their heavy dependencies lazily, so importing them here (which registers them) is cheap."""
from ...errors import KvarnError, choices
from . import hf_engine, vllm_engine  # noqa: F401  (register the built-in engines)
from .base import ENGINES, Engine, EngineResult, register_engine


def get_engine(name: str) -> Engine:
    if name not in ENGINES:
        raise KvarnError(f"unknown --engine {name!r}; accepted: auto, {choices(ENGINES)}")
    return ENGINES[name]()


__all__ = ["ENGINES", "Engine", "EngineResult", "get_engine", "register_engine"]
