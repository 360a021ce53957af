"""KV-cache capacity as vLLM 0.26 computes it, from a model shape and a format of the registry.

vLLM: available = gpu_memory_utilization x total - weights - (activation peak + non-torch memory), then
num_blocks = available // sum(page bytes of every layer), tokens = num_blocks x block_size. Formats that keep
16-bit per-request buffers outside the pool (KVarN's unfinished tile) have them reserved from the same budget
for `max_num_seqs` requests, so the figure is what a server can really hold.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import KvarnError
from .formats import KVFormat, get_format
from .shapes import ModelShape

GIB = 1 << 30
H200_GIB = 143771 / 1024  # what torch / nvidia-smi report for an H200 (143,771 MiB)
# Non-KV memory besides weights (activation peak at 16,384 batched tokens, non-torch allocations, CUDA graphs),
# calibrated on vLLM 0.26.0 / H200 / Qwen3-8B shape: 0.9 x 140.40 - 15.26 (weights) - 108.74 (KV) GiB.
DEFAULT_OVERHEAD_GIB = 2.37
DEFAULT_BLOCK = 16
DEFAULT_MAX_NUM_SEQS = 256  # tail slots reserved for KVarN when --max-num-seqs is not given


@dataclass
class Capacity:
    kv_dtype: str
    block_size: int
    bytes_per_token: float  # all layers, one GPU, paged pool only
    fixed_bytes_per_request: int  # 16-bit buffers outside the pool, all layers, one GPU
    reserved_requests: int  # requests the fixed buffers are reserved for
    available_bytes: float  # KV budget of one GPU before reservations
    num_blocks: int
    kv_tokens: int  # num_blocks x block_size (vLLM's "GPU KV cache size", within a token, at whole-block max_model_len)
    ratio_vs_fp16: float
    max_concurrency: float | None  # requests of --context tokens that fit at once
    context: int | None

    def as_dict(self) -> dict:
        return asdict(self)


def layer_slot_bytes(shape: ModelShape, fmt: KVFormat, layer: int) -> int:
    """Page bytes per token per KV head of one layer (16-bit boundary / sliding layers fall back)."""
    sixteen = get_format("auto")
    if fmt.is_16bit_layer(layer, shape.num_layers):
        return sixteen.slot_bytes(shape.head_dim)
    if fmt.quantized() and layer in set(shape.sliding_window_layers()):
        return sixteen.slot_bytes(shape.head_dim)
    return fmt.slot_bytes(shape.head_dim)


def bytes_per_token(shape: ModelShape, fmt: KVFormat, tp: int = 1) -> int:
    heads = shape.kv_heads_per_rank(tp)
    return sum(layer_slot_bytes(shape, fmt, i) * heads for i in range(shape.num_layers))


def fixed_bytes_per_request(shape: ModelShape, fmt: KVFormat, tp: int = 1) -> int:
    tokens = fmt.fixed_tokens_per_request()
    if not tokens:
        return 0
    sixteen = get_format("auto").slot_bytes(shape.head_dim)
    quant_layers = sum(1 for i in range(shape.num_layers) if layer_slot_bytes(shape, fmt, i) != sixteen)
    return tokens * shape.kv_heads_per_rank(tp) * sixteen * quant_layers


def block_size_for(shape: ModelShape, fmt: KVFormat) -> int:
    if fmt.block_size:
        return fmt.block_size
    if fmt.boundary_layers and fmt.quantized():
        return 2 * DEFAULT_BLOCK  # vLLM aligns heterogeneous pages by bumping the block (16 -> 32)
    return DEFAULT_BLOCK


def available_kv_bytes(shape: ModelShape, tp: int, gpu_mem_gib: float, utilization: float,
                       weights_dtype: str | None = None, overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> float:
    if not 0 < utilization <= 1:
        raise KvarnError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if not 0 < gpu_mem_gib < 10_000:
        raise KvarnError(f"--gpu-mem-gib must be a positive number of GiB, got {gpu_mem_gib}")
    if overhead_gib < 0:
        raise KvarnError(f"overhead must be >= 0 GiB, got {overhead_gib}")
    avail = utilization * gpu_mem_gib * GIB - shape.weight_bytes(weights_dtype) / tp - overhead_gib * GIB
    if avail <= 0:
        raise KvarnError(
            f"{shape.name} at TP={tp} does not fit: {shape.weight_bytes(weights_dtype) / tp / GIB:.1f} GiB of weights per GPU "
            f"in {utilization:.2f} x {gpu_mem_gib:.1f} GiB; raise --tp or --gpu-memory-utilization"
        )
    return avail


def capacity(shape: ModelShape, fmt: KVFormat, *, tp: int = 1, gpu_mem_gib: float = H200_GIB,
             utilization: float = 0.9, weights_dtype: str | None = None, context: int | None = None,
             max_num_seqs: int | None = None, overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> Capacity:
    shape.check_tp(tp)
    if context is not None and context < 1:
        raise KvarnError(f"--context must be a positive number of tokens, got {context}")
    avail = available_kv_bytes(shape, tp, gpu_mem_gib, utilization, weights_dtype, overhead_gib)
    per_tok = bytes_per_token(shape, fmt, tp)
    fixed = fixed_bytes_per_request(shape, fmt, tp)
    reserved = (max_num_seqs or DEFAULT_MAX_NUM_SEQS) if fixed else 0
    block = block_size_for(shape, fmt)
    pool = avail - reserved * fixed
    num_blocks = max(0, int(pool // (per_tok * block)))
    tokens = num_blocks * block
    fp16 = get_format("auto")
    fp16_blocks = int(avail // (bytes_per_token(shape, fp16, tp) * DEFAULT_BLOCK))
    ratio = tokens / (fp16_blocks * DEFAULT_BLOCK) if fp16_blocks else float("nan")
    conc = None
    if context:
        conc = num_blocks / -(-context // block)
        if reserved:
            conc = min(conc, reserved)
    return Capacity(fmt.name, block, per_tok, fixed, reserved, avail, num_blocks, tokens, ratio, conc, context)
