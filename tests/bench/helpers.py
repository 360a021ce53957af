"""Helpers shared by the bench tests: a fake bench engine (registered per test by the fake_bench_engine fixture of
tests/conftest.py) and vLLM's printed KV-cache capacity."""
import os
from pathlib import Path

from kvarn.bench.engines.base import Engine, EngineResult
from kvarn_cli.app import main

CALLS: list = []  # (kv dtype, repeat) of each cell the fake engine ran, in order
KV = {"auto": 1000.0, "fp8": 2000.0, "turboquant_4bit_nc": 3500.0, "kvarn_k4v2_g128": 4700.0}


class FakeEngine(Engine):
    """Capacity KV[kv dtype], 100 out tok/s for FP16 and 80 for the rest; turboquant_k3v4_nc fails, and the kv dtype
    named by FAKE_FAIL raises (an engine bug, which must become a failed row)."""
    name = "fake"
    modes = ("offline", "serve")
    default_timeout_s = 30.0

    def run(self, cell, timeout_s):
        CALLS.append((cell.config.kv_dtype, cell.repeat))
        Path(cell.log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(cell.log_path).write_text("fake engine log\n")
        if os.environ.get("FAKE_FAIL") == cell.config.kv_dtype:
            raise RuntimeError("engine crashed")
        if cell.config.kv_dtype == "turboquant_k3v4_nc":
            return EngineResult("failed", "RuntimeError: Triton compile failed")
        tok = 100.0 if cell.config.kv_dtype == "auto" else 80.0
        return EngineResult("ok", "", {"output_tok_s": tok, "total_tok_s": 2 * tok, "kv_tokens": KV[cell.config.kv_dtype],
                                       "engine_start_s": 1.0})


def bench(tmp_path, *args) -> int:
    """`kvarn bench --engine fake` into tmp_path/res (2K burst, 4 requests): its exit code; CALLS lists its cells."""
    CALLS.clear()
    return main(["bench", "--engine", "fake", "--out", str(tmp_path / "res"), "--burst", "2k", "--requests", "4",
                 *args])


def vllm_logged_tokens(num_blocks: int, max_model_len: int, block: int) -> int:
    """The KV-cache capacity vLLM prints for a pool: a copy of vLLM 0.26's get_kv_cache_capacity (kv_cache_utils),
    int(num_blocks / cdiv(L, block_size) * L)."""
    return int(num_blocks / -(-max_model_len // block) * max_model_len)
