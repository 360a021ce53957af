"""Small shared helpers of the plugin (no vLLM import at module load)."""
from __future__ import annotations

import functools
import importlib

from .. import settings
from ..formats import DEFAULT_KVARN, KVFormat, get_format, kvarn_formats

PREFIX = "kvarn_"
# head dims the plugin serves (every kernel the backend calls is tested at each: tests/kernels/test_kernels_gpu.py)
SUPPORTED_HEAD_SIZES = (64, 128, 256)
SUPPORTED_VLLM = "0.26."

_ACTIVE: dict[str, KVFormat] = {}


def is_kvarn(kv_cache_dtype) -> bool:
    return isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith(PREFIX)


def kvarn_dtype_names() -> tuple[str, ...]:
    return tuple(f.name for f in kvarn_formats())


def set_active_format(name: str) -> KVFormat:
    fmt = get_format(name)
    _ACTIVE["fmt"] = fmt
    return fmt


def active_format() -> KVFormat:
    """The KVarN format of this process (one per engine): set when a KVarN layer or config is seen; else read from
    vLLM's current config; else the default preset."""
    fmt = _ACTIVE.get("fmt")
    if fmt is not None:
        return fmt
    try:
        from vllm.config import get_current_vllm_config

        cd = get_current_vllm_config().cache_config.cache_dtype
        if is_kvarn(cd):
            return set_active_format(cd)
    except Exception:  # noqa: BLE001 - no vLLM / no current config
        pass
    return get_format(DEFAULT_KVARN)


def fallback_reason(*, head_size: int, head_size_v: int | None, sliding_window, attn_type: str, alibi: bool,
                    soft_cap, has_sink: bool) -> str | None:
    """Why a layer cannot be served by KVarN (it then keeps a 16-bit cache), or None."""
    if attn_type not in ("decoder", None):
        return f"{attn_type} attention"
    if sliding_window is not None:
        return "sliding-window attention"
    if head_size not in SUPPORTED_HEAD_SIZES:
        return f"head_dim {head_size} (kernels serve {', '.join(map(str, SUPPORTED_HEAD_SIZES))})"
    if head_size_v is not None and head_size_v != head_size:
        return f"value head_dim {head_size_v} != key head_dim {head_size}"
    if alibi:
        return "ALiBi"
    if soft_cap:
        return "logits soft-capping"
    if has_sink:
        return "attention sinks"
    return None


def defer_flush_enabled() -> bool:
    """KVARN_DEFER_FLUSH (on by default): decode steps leave the tile they complete in the 16-bit tail (read there)
    and the next step's metadata build flushes every layer's completed tiles in one launch (kernels.store.
    flush_layers) instead of one latency-bound flush per layer inside the step."""
    return bool(settings.get("KVARN_DEFER_FLUSH"))


@functools.lru_cache(maxsize=None)  # every layer of a step asks for its kernels: the import machinery once
def kernel_lookup(module: str, name: str):
    """kvarn.kernels.<module>.<name>, or the ImportError of that module (remembered too: a machine without Triton
    stays without); the callers decide whether a missing kernel is a fallback or an error. Any other import error
    (a broken Triton build) raises as it is, and is not remembered."""
    try:
        mod = importlib.import_module(f"kvarn.kernels.{module}")
    except ImportError as e:
        return e
    return getattr(mod, name)
