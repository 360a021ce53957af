"""One benchmark configuration (a cell of the matrix) and the run-wide options shared by every cell.

The configuration fields are what the results store hashes for resume: everything that changes the numbers is in
`BenchConfig`; the repeat index, timeouts and output paths are not.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..results import config_hash

OFFLINE, SERVE = "offline", "serve"
MODES = (OFFLINE, SERVE)
MODE_ALIASES = {"throughput": OFFLINE, "offline": OFFLINE, "serve": SERVE, "online": SERVE}
SERVE_ONLY_FIELDS = ("request_rate", "burstiness", "concurrency_limit", "goodput")


@dataclass(frozen=True)
class BenchConfig:
    model: str  # what the rows call the model: hub id for bundled shapes, the path for local folders
    kv_dtype: str
    tp: int
    engine: str  # vllm | hf | a test engine
    mode: str  # offline | serve
    burst: int  # context per request = prompt_len + output_len
    prompt_len: int
    output_len: int
    requests: int
    gpu_memory_utilization: float
    max_num_seqs: int | None
    dummy_weights: bool
    seed: int
    model_dtype: str | None = None  # None: the engine's default for the model (fp8 forces bfloat16)
    engine_args: str = "{}"  # JSON of extra engine arguments (sorted keys)
    # serve mode only (kept out of the hash for offline rows so serve flags never split offline cells)
    request_rate: float | None = None  # None = inf: all requests at once
    burstiness: float = 1.0
    concurrency_limit: int | None = None  # --max-concurrency (the metric max_concurrency is KV-derived)
    goodput: str = "{}"  # JSON {"ttft": ms, ...}
    # KVarN cells: the result-changing settings with their values (kvarn.settings.result_env), so a run with another
    # value is a cell of its own; empty for other formats (in the hash only when set)
    backend_env: str = ""
    # not part of the hash: where to load from (the model column is the identity)
    model_path: str = field(default="", compare=False)
    weights: str | None = field(default=None, compare=False)

    def hash_fields(self) -> dict:
        d = asdict(self)
        d.pop("model_path")
        d.pop("weights")
        if not self.backend_env:
            d.pop("backend_env")
        if self.mode != SERVE:
            for k in SERVE_ONLY_FIELDS:
                d.pop(k)
        return d

    @property
    def hash(self) -> str:
        return config_hash(self.hash_fields())

    def row_fields(self) -> dict:
        """Configuration columns of a result row (serve-only fields null in offline rows)."""
        d = asdict(self)
        d.pop("model_path")
        if self.mode != SERVE:
            for k in SERVE_ONLY_FIELDS:
                d[k] = None
        return d

    def engine_arg_dict(self) -> dict:
        return json.loads(self.engine_args)

    def label(self) -> str:
        return f"{self.model} {self.kv_dtype} TP={self.tp} {self.requests}x({self.prompt_len}+{self.output_len})"


@dataclass(frozen=True)
class Cell:
    """One (configuration, repeat): what an engine runs and what becomes one result row."""
    config: BenchConfig
    repeat: int
    run_id: str
    log_path: str  # DIR/logs/<config_hash>-r<k>.log

    @property
    def hash(self) -> str:
        return self.config.hash
