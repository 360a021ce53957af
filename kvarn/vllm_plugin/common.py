"""Small shared helpers of the plugin (no vLLM import at module load)."""
from __future__ import annotations

import os

from ..formats import DEFAULT_BALANCE_ITERS, DEFAULT_KVARN, KVFormat, get_format, kvarn_formats

PREFIX = "kvarn_"
# head dims the plugin serves (every kernel the backend calls passed tests/test_kernels_gpu.py at each of them on the
# H200: store and decode at 256 in session 6, the dense prefill path's record decoder in session 8)
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


# Environment knobs of the backend that change what a run measures (defaults = what the code does unset).
# Results carry the non-default ones (provenance `kvarn_env`, and the bench configuration hash).
BACKEND_KNOBS = {"KVARN_PREFILL": "dense", "KVARN_FULL_GRAPH": "1", "KVARN_AUTOTUNE": "0", "KVARN_DECODE_CONFIG": "",
                 "KVARN_STORE_BALANCE": "fused", "KVARN_STORE_DECODE_GRID": "rows", "KVARN_SINK": "16",
                 "KVARN_BALANCE_ITERS": str(DEFAULT_BALANCE_ITERS), "KVARN_DEFER_FLUSH": "1", "KVARN_PDL": "1"}


def defer_flush_enabled() -> bool:
    """On (the default since session 19; KVARN_DEFER_FLUSH=0 turns it off): decode steps leave the tile they complete
    in the 16-bit tail (read there) and the next step's metadata build flushes every layer's completed tiles in one
    launch (kernels.store.flush_layers), instead of one latency-bound flush per layer inside the step (+3% on the
    Qwen3-8B showcase, BENCHMARKS.md sessions 13 and 19). Set but empty counts as unset, as in backend_env."""
    return (os.environ.get("KVARN_DEFER_FLUSH", "").strip() or BACKEND_KNOBS["KVARN_DEFER_FLUSH"]) == "1"


# Knobs of the method itself (the PyTorch reference and the hf engine read them too, not only the vLLM backend).
METHOD_KNOBS = ("KVARN_BALANCE_ITERS", "KVARN_SINK")
# Knobs whose default changed after results were stored, with the value the older rows were hashed at: the effective
# value is listed whenever it differs from that one, set or not, so a rerun at the new default never resumes from
# (or merges with) rows measured at the old one. KVARN_BALANCE_ITERS: 8 until session 10, 3 since. KVARN_DECODE_CONFIG
# (unset: kvarn.kernels.decode.DEFAULT_CONFIG): the 4-warp 3-stage pipe kernel until session 14 (compared lower-case;
# later defaults, u2k2v1w2s5x1n8L2p1 in session 14, p2 in 15, p2t1g1 in 16 and u2k3...p2t1g1 since 18, differ from
# it, so their rows list the name). KVARN_DEFER_FLUSH: off until session 19, on since (rows list it as =1, the same
# hash as the earlier A/B rows that set it).
HASHED_AT = {"KVARN_BALANCE_ITERS": "8", "KVARN_DECODE_CONFIG": "u2k2v1w4s3x1r128n8l2p1", "KVARN_DEFER_FLUSH": "0"}


def _knob_default(key: str, default: str) -> str:
    """The value a knob takes when unset (the decode config's is the kernels' DEFAULT_CONFIG, imported lazily)."""
    if key == "KVARN_DECODE_CONFIG" and not default:
        try:
            from ..kernels.decode import DEFAULT_CONFIG
        except ImportError:  # no Triton: no decode kernels, nothing to record
            return HASHED_AT[key]
        return DEFAULT_CONFIG.name
    return default


def backend_env(environ=None, method_only: bool = False) -> str:
    """'KEY=value;...' of the backend knobs set to a non-default value (HASHED_AT's: whose effective value is not
    the one older rows were hashed at), sorted; '' when there are none. method_only: METHOD_KNOBS only."""
    env = os.environ if environ is None else environ
    out = []
    for k, default in sorted(BACKEND_KNOBS.items()):
        if method_only and k not in METHOD_KNOBS:
            continue
        v = env.get(k)
        v = None if v is None else v.strip()
        if k in HASHED_AT:
            eff = v or _knob_default(k, default)
            if eff.lower() != HASHED_AT[k]:
                out.append(f"{k}={eff}")
        elif v is not None and v.lower() != default:
            out.append(f"{k}={v}")
    return ";".join(out)
