"""Engines behind one interface (base.Engine): `vllm` (a fresh process per cell) and `hf` (transformers)."""
from .base import ENGINES, Engine, EngineResult, get_engine, register_engine

__all__ = ["ENGINES", "Engine", "EngineResult", "get_engine", "register_engine"]
