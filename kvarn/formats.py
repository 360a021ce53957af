"""The one registry of KV-cache formats used by the whole project.

Each entry knows how vLLM 0.26 spells it, its bits, its tile, its exact page bytes per token per KV head
(vLLM's own accounting, padding included), which layers stay 16-bit, the block size it needs, the model
dtypes it runs with, and the fixed 16-bit per-request buffers it needs (KVarN's unfinished tile and sink).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import settings
from .errors import KvarnError, choices

FP16_NAMES = ("auto", "float16", "bfloat16")


# Balancing iterations per tile: 3, where the method note ships 8 (docs/format.md, "Numerics"; 16 in the paper;
# "accuracy identical"). They are the store's latency chain (a flush at 3 takes ~60% of one at 8, BENCHMARKS.md).
# Accuracy (CPU reference, BENCHMARKS.md "Method fidelity"): SmolLM2 and heavy-tailed synthetic K/V give the same
# value / attention errors at 8, 4, 3 and 2 to the third digit, perplexity within noise; 1 is 3% worse. 3 keeps one
# iteration of margin above that knee. KVARN_BALANCE_ITERS (kvarn.settings) changes the method for the store kernels
# and the reference alike.
DEFAULT_BALANCE_ITERS = settings.BY_NAME["KVARN_BALANCE_ITERS"].default


@dataclass(frozen=True)
class KVFormat:
    name: str  # as vLLM spells it (--kv-cache-dtype)
    family: str  # "fp16" | "fp8" | "turboquant" | "kvarn"
    key_bits: float
    value_bits: float
    group: int | None = None  # tile = vLLM block (tokens) for KVarN
    block_size: int | None = None  # block size the format requires (None: vLLM's default)
    model_dtypes: tuple[str, ...] = ("float16", "bfloat16")
    model_dtypes_why: str = ""  # why other model dtypes cannot run it (said in the error)
    boundary_layers: int = 0  # first and last N decoder layers kept 16-bit (dense models)
    tail_tokens: int = 0  # 16-bit tokens per request per layer for the unfinished tile
    sink_tokens: int = 0  # 16-bit tokens per request per layer kept for good (attention sinks)
    window_tokens: int = 0  # KVarN: the last W tokens of a tile also kept 16-bit, for the last two tiles (the window)
    balance_iters: int = DEFAULT_BALANCE_ITERS  # KVarN: Sinkhorn-like balancing iterations per tile (best kept)
    description: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)

    # ---- bytes -------------------------------------------------------------------------------
    def record_bytes(self, head_dim: int) -> int:
        """Bytes of one (tile, KV head) record for KVarN; one token's slot for other formats."""
        if self.family == "kvarn":
            return kvarn_record_bytes(head_dim, self.group, int(self.key_bits), int(self.value_bits))
        return self.slot_bytes(head_dim)

    def slot_bytes(self, head_dim: int) -> int:
        """Bytes per token per KV head as vLLM's page accounting sees it (key + value)."""
        d = head_dim
        if self.family == "fp16":
            return 2 * d * 2
        if self.family == "fp8":
            return 2 * d
        if self.family == "turboquant":
            # vLLM 0.26 TurboQuantConfig: key = fp8 (d B) or MSE indices + fp16 norm; value = packed + fp16 scale/zero;
            # slot rounded up to an even size.
            key = d if self.key_bits == 8 else math.ceil(d * self.key_bits / 8) + 2
            value = math.ceil(d * self.value_bits / 8) + 4
            s = key + value
            return s + (s % 2)
        if self.family == "kvarn":
            rec = self.record_bytes(d)
            if rec % self.group:
                raise KvarnError(f"{self.name}: record of {rec} B does not split into {self.group} token slots")
            return rec // self.group
        raise AssertionError(self.family)

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        return float(self.slot_bytes(head_dim))

    def fixed_tokens_per_request(self) -> int:
        """16-bit tokens per request per layer held outside the paged pool (tail + sink + the two window halves)."""
        return self.tail_tokens + self.sink_tokens + 2 * self.window_tokens

    @property
    def tail_rows(self) -> int:
        """Rows of a request's 16-bit tail buffer per layer and KV head (docs/format.md): [0, g) the unfinished tile,
        [g, g + sink) the sink, then the window halves of even and odd tiles, W rows each."""
        return (self.group or 0) + self.sink_tokens + (2 * self.window_tokens if self.sink_tokens else 0)

    def quantized(self) -> bool:
        return self.family != "fp16"

    def is_16bit_layer(self, layer: int, num_layers: int) -> bool:
        n = min(self.boundary_layers, num_layers // 2)
        return layer < n or layer >= num_layers - n

    def check_model_dtype(self, dtype: str | None) -> None:
        """One clear line where an explicit model dtype cannot run this format (None / auto: the engine picks)."""
        dtype = {"half": "float16", "float": "float32"}.get(dtype, dtype)  # vLLM's other spellings
        if dtype in (None, "auto") or dtype in self.model_dtypes:
            return
        why = f" ({self.model_dtypes_why})" if self.model_dtypes_why else ""
        raise KvarnError(f"kv dtype {self.name!r} does not run with model dtype {dtype!r}{why}; accepted: "
                         f"{choices(self.model_dtypes)}; drop --dtype {dtype} or drop {self.name} from --kv-dtype")


def kvarn_record_bytes(head_dim: int, group: int, key_bits: int, value_bits: int) -> int:
    """Exact KVarN record (docs/format.md): packed keys + sK,zK (per channel) + rK (per token), then
    packed values + sV,zV (per token) + cV (per channel); all vectors fp16; total padded to 16 bytes."""
    d, g = head_dim, group
    keys = math.ceil(d * g * key_bits / 8) + 2 * (2 * d + g)
    values = math.ceil(g * d * value_bits / 8) + 2 * (2 * g + d)
    total = keys + values
    return -(-total // 16) * 16


# The first KVARN_SINK tokens of every request stay 16-bit for good (attention sinks; the original keeps 128) in the
# tail buffer beside the unfinished tile. CPU reference, SmolLM2-135M, Moby-Dick 8 x 1024 windows, chunk 128,
# kvarn_k4v2_g128 ppl vs fp16 (BENCHMARKS.md): no sink +1.81%, 4 tokens +0.95%, 16 +0.81%, 32 +1.10%, 64 +0.57%,
# 128 (the whole first tile) +0.32% (n = 8 windows: +-0.3-0.6% noise). 16 tokens cost 1/8 of the tail buffer
# (~0.6 GB at 256 requests on Qwen3-8B), 128 would cost 4.8 GB (capacity 4.54x -> ~4.35x). KVARN_SINK (kvarn.settings,
# read once per process, so set it for every process) trades capacity for accuracy.
# The window: a query attends most to its recent tokens, and right after a tile completes they are all quantized. So
# the last g/4 positions of the tile before the newest position's tile are read 16-bit too (float16 reference, chunk
# 128: SmolLM2 +0.98% -> +0.59%, Qwen2.5-Coder-0.5B +0.77% -> +0.52%, -1.5B +0.63% -> +0.26%; BENCHMARKS.md). Every
# token in a tile's last g/4 positions is also written to the window half of its tile's parity, so a chunk that
# completes the next tile leaves the previous tile's window intact.


def _sink_for(g: int) -> int:
    # fewer tokens than a tile (the kernels keep part of the first tile's record visible); a larger KVARN_SINK is
    # capped per preset (g64 presets hold at most 63) rather than breaking the import for every preset
    return min(settings.get("KVARN_SINK"), g - 1)


def _kvarn(kb: int, vb: int, g: int, desc: str) -> KVFormat:
    sink = _sink_for(g)
    return KVFormat(
        name=f"kvarn_k{kb}v{vb}_g{g}",
        family="kvarn",
        key_bits=kb,
        value_bits=vb,
        group=g,
        block_size=g,
        tail_tokens=g,
        sink_tokens=sink,
        # with a sink that stays clear of it (the kernels would read a position twice)
        window_tokens=g // 4 if 0 < sink <= g - g // 4 else 0,
        balance_iters=settings.get("KVARN_BALANCE_ITERS"),
        description=desc,
    )


def _tq(name: str, kb: int, vb: int, desc: str) -> KVFormat:
    return KVFormat(name=name, family="turboquant", key_bits=kb, value_bits=vb, boundary_layers=2, description=desc)


REGISTRY: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("auto", "fp16", 16, 16, model_dtypes=("float16", "bfloat16", "float32"),
                 description="the model's own 16-bit dtype (FP16 baseline)", aliases=("fp16",)),
        KVFormat("float16", "fp16", 16, 16, model_dtypes=("float16", "bfloat16", "float32"), description="fp16 cache"),
        KVFormat("bfloat16", "fp16", 16, 16, model_dtypes=("float16", "bfloat16", "float32"), description="bf16 cache"),
        KVFormat("fp8", "fp8", 8, 8, model_dtypes=("bfloat16",), description="fp8 e4m3, per-tensor scale 1.0",
                 model_dtypes_why="vLLM's FlashAttention 3 takes an fp8 cache only with bfloat16 output",
                 aliases=("fp8_e4m3",)),
        _tq("turboquant_k8v4", 8, 4, "TurboQuant: fp8 keys, 4-bit values"),
        _tq("turboquant_4bit_nc", 4, 4, "TurboQuant: 4-bit MSE keys, 4-bit values, norm correction"),
        _tq("turboquant_k3v4_nc", 3, 4, "TurboQuant: 3-bit MSE keys, 4-bit values, norm correction"),
        _tq("turboquant_3bit_nc", 3, 3, "TurboQuant: 3-bit MSE keys, 3-bit values, norm correction"),
        _kvarn(4, 2, 128, "KVarN: 4-bit keys, 2-bit values, 128-token tiles (default)"),
        _kvarn(4, 4, 128, "KVarN: 4-bit keys, 4-bit values, 128-token tiles"),
        _kvarn(4, 2, 64, "KVarN: 4-bit keys, 2-bit values, 64-token tiles"),
        _kvarn(2, 2, 128, "KVarN: 2-bit keys, 2-bit values, 128-token tiles"),
    )
}
DEFAULT_KVARN = "kvarn_k4v2_g128"
_ALIASES = {a: f.name for f in REGISTRY.values() for a in f.aliases}


def get_format(name: str) -> KVFormat:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in REGISTRY:
        raise KvarnError(f"unknown kv dtype {name!r}; accepted: {choices(REGISTRY)} (aliases: {choices(_ALIASES)})")
    return REGISTRY[key]


def parse_formats(spec: str | None, default: tuple[str, ...] | None = None) -> list[KVFormat]:
    """A comma list of kv dtypes ('all' = every entry), duplicates dropped, order kept."""
    if not spec:
        names = list(default) if default else list(REGISTRY)
    elif spec.strip().lower() == "all":
        names = list(REGISTRY)
    else:
        names = [s for s in (p.strip() for p in spec.split(",")) if s]
    out: list[KVFormat] = []
    for n in names:
        f = get_format(n)
        if f not in out:
            out.append(f)
    return out


def kvarn_formats() -> list[KVFormat]:
    return [f for f in REGISTRY.values() if f.family == "kvarn"]
