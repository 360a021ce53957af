"""Model shapes: what capacity, benchmarks and dummy-weight runs need to know about an architecture.

A model is named by a bundled short name (`suites/models/NAME.json`, the published config.json), a local
Hugging Face folder or config.json, or a hub id (`Qwen/Qwen3-32B`) that resolves through the local HF cache
or the bundled shape of the same model. Nothing is downloaded.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import KvarnError, choices
from .paths import models_dir

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class ModelShape:
    name: str  # short name or path the user gave, normalised
    hf_id: str | None
    config: dict
    source: str  # "bundled" | "local" | "hf-cache"
    path: Path | None  # folder or file holding config.json (None never happens for resolved shapes)

    @property
    def label(self) -> str:
        """The `model` column of result rows (bench and eval alike): the hub id, else the resolved local path."""
        if self.source == "local":
            return str(Path(self.path).resolve())
        return self.hf_id or self.name

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def num_q_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_q_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.hidden_size // self.num_q_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_context(self) -> int:
        return int(self.config.get("max_position_embeddings", 4096))

    @property
    def dtype(self) -> str:
        return str(self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16")

    def sliding_window_layers(self) -> list[int]:
        """Layers with a sliding window (served 16-bit by quantized formats)."""
        c = self.config
        if c.get("layer_types"):
            return [i for i, t in enumerate(c["layer_types"]) if t == "sliding_attention"]
        if c.get("sliding_window") and c.get("use_sliding_window", True):
            start = int(c.get("max_window_layers", 0)) if c.get("model_type", "").startswith("qwen") else 0
            return list(range(start, self.num_layers))
        return []

    def num_params(self) -> int:
        """Parameter count of a dense decoder (weights bytes for the capacity model)."""
        c, h, d = self.config, self.hidden_size, self.head_dim
        inter = int(c.get("intermediate_size", 4 * h))
        attn = h * self.num_q_heads * d * 2 + h * self.num_kv_heads * d * 2
        if c.get("attention_bias"):
            attn += self.num_q_heads * d + 2 * self.num_kv_heads * d + h
        norms = 2 * h + (2 * d if c.get("model_type") == "qwen3" else 0)
        per_layer = attn + 3 * h * inter + norms
        embed = self.vocab_size * h * (1 if c.get("tie_word_embeddings") else 2)
        return embed + self.num_layers * per_layer + h

    def weight_bytes(self, dtype: str | None = None) -> float:
        dt = dtype or self.dtype
        if dt not in DTYPE_BYTES:
            raise KvarnError(f"unknown weights dtype {dt!r}; accepted: {choices(DTYPE_BYTES)}")
        return self.num_params() * DTYPE_BYTES[dt]

    def tp_sizes(self, limit: int | None = None) -> list[int]:
        """Tensor-parallel sizes that split this model's heads evenly, up to `limit` (what the machine runs)."""
        return [t for t in range(1, self.num_q_heads + 1)
                if self.num_q_heads % t == 0 and t <= min(64, limit or 64)]

    def check_tp(self, tp: int, limit: int | None = None, why: str = "") -> None:
        """`limit` / `why`: the largest size the engine runs here and the reason, so that no accepted value
        offered fails next."""
        if tp < 1:
            raise KvarnError(f"tensor-parallel size must be >= 1, got {tp}")
        if self.num_q_heads % tp:
            raise KvarnError(f"--tp {tp} does not divide the {self.num_q_heads} attention heads of {self.name}; "
                             f"accepted: {choices(self.tp_sizes(limit))}" + (f" ({why})" if limit else ""))
        if limit is not None and tp > limit:
            raise KvarnError(f"--tp {tp}: {why}; accepted: {choices(self.tp_sizes(limit))}")

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads per GPU (replicated when there are fewer KV heads than ranks, as vLLM does)."""
        return max(1, self.num_kv_heads // tp)


def bundled_models() -> dict[str, Path]:
    return {p.stem: p for p in sorted(models_dir().glob("*.json"))}


def hf_cache_config(hf_id: str) -> Path | None:
    roots = [os.environ.get("HF_HUB_CACHE"), os.environ.get("HUGGINGFACE_HUB_CACHE")]
    hf_home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    roots.append(str(Path(hf_home) / "hub"))
    for root in filter(None, roots):
        snaps = Path(root) / f"models--{hf_id.replace('/', '--')}" / "snapshots"
        for cfg in sorted(snaps.glob("*/config.json")) if snaps.is_dir() else []:
            return cfg
    return None


_REQUIRED = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")


def _checked(config: dict, where) -> dict:
    """The decoder's config: a multimodal config's text_config where the top level lacks the fields; a config
    without them is one line naming what is missing, not a KeyError later."""
    if not all(k in config for k in _REQUIRED) and isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise KvarnError(f"{where} is not a decoder LLM config: it lacks {', '.join(missing)}")
    return config


def resolve_model(spec: str) -> ModelShape:
    """Resolve a short name, local folder / config.json, or hub id to a shape, offline."""
    if not spec or not spec.strip():
        raise KvarnError("empty --model; give a bundled name, a local folder or a hub id")
    spec = spec.strip()
    bundled = bundled_models()
    p = Path(spec).expanduser()
    if p.exists():
        cfg = p / "config.json" if p.is_dir() else p
        if not cfg.is_file():
            raise KvarnError(f"model folder {spec!r} has no config.json")
        try:
            config = json.loads(cfg.read_text())
        except (OSError, ValueError) as e:
            raise KvarnError(f"cannot read {cfg}: {e}") from None
        config = _checked(config, cfg)
        return ModelShape(p.name if p.is_dir() else p.parent.name, config.get("_name_or_path"), config, "local",
                          cfg.parent)
    key = spec.lower()
    if key in bundled:
        config = json.loads(bundled[key].read_text())
        return ModelShape(key, config.get("_name_or_path"), config, "bundled", bundled[key])
    if "/" in spec:
        cached = hf_cache_config(spec)
        if cached:
            config = _checked(json.loads(cached.read_text()), cached)
            return ModelShape(spec.split("/")[-1].lower(), spec, config, "hf-cache", cached.parent)
        for name, path in bundled.items():
            config = json.loads(path.read_text())
            if str(config.get("_name_or_path", "")).lower() == key or spec.split("/")[-1].lower() == name:
                return ModelShape(name, spec, config, "bundled", path)
        raise KvarnError(
            f"model {spec!r} is not in the local Hugging Face cache and has no bundled shape; "
            f"download it or give a local folder; bundled: {choices(bundled)}"
        )
    raise KvarnError(f"unknown model {spec!r}; accepted: {choices(bundled)}, a local folder, or a hub id like Qwen/Qwen3-8B")


def model_label(spec: str) -> str:
    """ModelShape.label for a --model value; the value itself where it names no shape kvarn can resolve offline."""
    try:
        return resolve_model(spec).label
    except KvarnError:
        return spec
