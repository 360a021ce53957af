"""The monkeypatches that make `--kv-cache-dtype kvarn_*` work on stock vLLM 0.26 ("approach A").

Each patch is idempotent (marked on the patched object) and leaves every other dtype's behaviour untouched:

1. dtypes: the KVarN presets join the `CacheDType` Literal (module, pydantic field of CacheConfig, EngineArgs field,
   selector assert), `STR_DTYPE_TO_TORCH_DTYPE` (uint8) and the CLI choices (`_compute_kwargs.cache_clear()`).
2. backend: `register_backend(CUSTOM, KvarnAttentionBackend)`; `platforms.cuda._get_backend_priorities` returns
   [CUSTOM] for kvarn_* dtypes (non-MLA), the original list otherwise.
3. layers: `Attention.__init__` gives layers KVarN cannot serve (sliding window, cross/encoder attention, odd head
   dims, ALiBi, soft-cap, sinks) a 16-bit cache ("auto"), said once per reason; `Attention.get_kv_cache_spec`
   returns `KvarnAttentionSpec` (true page bytes) for KVarN layers.
4. config: `EngineArgs.create_engine_config` checks block size / model dtype / head size / speculative decoding with
   an error naming the fix, sets the block size to the tile and max_num_seqs to DEFAULT_MAX_NUM_SEQS when unset.
5. worker: `Worker.determine_available_memory` subtracts the 16-bit tail buffers (max_num_seqs + 1 slots per KVarN
   layer) from the KV budget, so vLLM's "GPU KV cache size" and num_gpu_blocks are what really fits;
   `Worker.init_device` hooks the model runner so every step knows each batch row's tail slot (tails.py).
"""
from __future__ import annotations

import copy
import functools
import inspect
import logging
import typing

import numpy as np

from ..capacity import DEFAULT_MAX_NUM_SEQS
from ..errors import KvarnError
from ..formats import get_format
from .common import (SUPPORTED_HEAD_SIZES, SUPPORTED_VLLM, fallback_reason, is_kvarn, kvarn_dtype_names,
                     set_active_format)
from .tails import STEP, SlotTable, tail_bytes

logger = logging.getLogger("vllm.kvarn")
BACKEND_PATH = "kvarn.vllm_plugin.backend.KvarnAttentionBackend"
_MARK = "_kvarn_patched"
_SAID: set[str] = set()


class KvarnConfigError(KvarnError, ValueError):
    """A configuration KVarN cannot run with; the message names the fix."""


def _once(key: str, msg: str, *args) -> None:
    if key not in _SAID:
        _SAID.add(key)
        logger.info(msg, *args)


def _wrapped(obj, name: str) -> bool:
    return getattr(getattr(obj, name, None), _MARK, False)


def _mark(fn):
    setattr(fn, _MARK, True)
    return fn


def apply() -> list[str]:
    """Apply every patch; returns the names of the patches that could be applied here."""
    done = []
    for name, fn in (("dtypes", patch_dtypes), ("backend", patch_backend), ("routing", patch_routing),
                     ("attention", patch_attention_layer), ("engine_args", patch_engine_args),
                     ("worker", patch_worker)):
        try:
            fn()
            done.append(name)
        except ImportError as e:  # a part of vLLM this process cannot import (e.g. no CUDA platform module)
            logger.debug("kvarn: patch %s skipped: %s", name, e)
    return done


# ---------------------------------------------------------------------------------------------------------------
# 1. dtypes


def extend_literal(lit, names):
    old = typing.get_args(lit)
    add = tuple(n for n in names if n not in old)
    return lit if not add else typing.Literal[old + add]


def patch_dtypes() -> None:
    import torch
    import vllm.config.cache as cache_mod
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    names = kvarn_dtype_names()
    for n in names:
        STR_DTYPE_TO_TORCH_DTYPE.setdefault(n, torch.uint8)
    new = extend_literal(cache_mod.CacheDType, names)
    if new is cache_mod.CacheDType:
        return
    cache_mod.CacheDType = new
    cc = cache_mod.CacheConfig
    cc.__dataclass_fields__["cache_dtype"].type = new
    cc.__annotations__["cache_dtype"] = new
    pf = getattr(cc, "__pydantic_fields__", {}).get("cache_dtype")
    if pf is not None:
        pf.annotation = new
    try:
        from pydantic.dataclasses import rebuild_dataclass

        rebuild_dataclass(cc, force=True)
        try:
            from vllm.config.vllm import VllmConfig

            rebuild_dataclass(VllmConfig, force=True)
        except Exception as e:  # noqa: BLE001 - nested instances are not re-validated; best effort
            logger.debug("kvarn: VllmConfig rebuild skipped: %s", e)
    except ImportError:
        pass
    try:
        import vllm.v1.attention.selector as selector

        selector.CacheDType = new
    except ImportError:
        pass
    try:
        import vllm.engine.arg_utils as au

        au.CacheDType = new
        f = au.EngineArgs.__dataclass_fields__.get("kv_cache_dtype")
        if f is not None:
            f.type = new
        if hasattr(au, "_compute_kwargs") and hasattr(au._compute_kwargs, "cache_clear"):
            au._compute_kwargs.cache_clear()
    except ImportError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# 2. backend registration and routing


def patch_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def routed_priorities(orig):
    @functools.wraps(orig)
    def _get_backend_priorities(use_mla, device_capability, num_heads=None, kv_cache_dtype=None,
                                use_non_causal=False):
        if not use_mla and is_kvarn(kv_cache_dtype):
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            return [AttentionBackendEnum.CUSTOM]
        return orig(use_mla, device_capability, num_heads, kv_cache_dtype, use_non_causal)

    return _mark(_get_backend_priorities)


def patch_routing() -> None:
    import vllm.platforms.cuda as cuda_mod

    if not _wrapped(cuda_mod, "_get_backend_priorities"):
        cuda_mod._get_backend_priorities = routed_priorities(cuda_mod._get_backend_priorities)


# ---------------------------------------------------------------------------------------------------------------
# 3. attention layers


def patch_attention_layer() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    if not _wrapped(Attention, "__init__"):
        Attention.__init__ = wrap_attention_init(Attention.__init__)
    if not _wrapped(Attention, "get_kv_cache_spec"):
        Attention.get_kv_cache_spec = wrap_get_kv_cache_spec(Attention.get_kv_cache_spec)


def wrap_attention_init(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        try:
            ba = sig.bind(self, *args, **kwargs)
        except TypeError:
            return orig(self, *args, **kwargs)
        a = ba.arguments
        cc = a.get("cache_config")
        if cc is not None and is_kvarn(getattr(cc, "cache_dtype", None)):
            set_active_format(cc.cache_dtype)
            sw = a.get("per_layer_sliding_window")
            if sw is None:
                sw = getattr(cc, "sliding_window", None)
            extra = a.get("extra_impl_args") or {}
            attn_type = a.get("attn_type", "decoder")
            reason = fallback_reason(
                head_size=a.get("head_size"), head_size_v=a.get("head_size_v"), sliding_window=sw,
                attn_type=str(getattr(attn_type, "value", attn_type)), alibi=a.get("alibi_slopes") is not None,
                soft_cap=a.get("logits_soft_cap"), has_sink=extra.get("sinks") is not None)
            if reason is not None:
                _once("fallback:" + reason, "kvarn: layers with %s keep a 16-bit KV cache (%s is not applied to "
                      "them)", reason, cc.cache_dtype)
                cc16 = copy.copy(cc)
                object.__setattr__(cc16, "cache_dtype", "auto")
                ba.arguments["cache_config"] = cc16
                return orig(*ba.args, **ba.kwargs)
        return orig(self, *args, **kwargs)

    return _mark(__init__)


def wrap_get_kv_cache_spec(orig):
    @functools.wraps(orig)
    def get_kv_cache_spec(self, vllm_config):
        if (is_kvarn(getattr(self, "kv_cache_dtype", None)) and str(getattr(self.attn_type, "value", self.attn_type))
                == "decoder" and self.sliding_window is None):
            from .backend import make_spec

            return make_spec(self, vllm_config.cache_config.block_size)
        return orig(self, vllm_config)

    return _mark(get_kv_cache_spec)


# ---------------------------------------------------------------------------------------------------------------
# 4. engine configuration


def patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if not _wrapped(EngineArgs, "create_engine_config"):
        EngineArgs.create_engine_config = wrap_create_engine_config(EngineArgs.create_engine_config)


def check_args_before(args) -> None:
    """On EngineArgs, before vLLM builds the config: block size and max_num_seqs defaults, early errors."""
    name = args.kv_cache_dtype
    fmt = get_format(name)
    set_active_format(fmt.name)
    if args.block_size is None:
        args.block_size = fmt.group
        _once("block", "kvarn: %s sets the KV block size to its tile, %d tokens", fmt.name, fmt.group)
    elif int(args.block_size) != fmt.group:
        raise KvarnConfigError(
            f"--kv-cache-dtype {fmt.name} needs --block-size {fmt.group} (one vLLM block = one {fmt.group}-token "
            f"tile), got --block-size {args.block_size}; pass --block-size {fmt.group} or leave it unset")
    if args.max_num_seqs is None:
        args.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        _once("seqs", "kvarn: max_num_seqs defaults to %d (the 16-bit tail buffer is reserved for that many "
              "requests; set --max-num-seqs to change it)", DEFAULT_MAX_NUM_SEQS)
    if getattr(args, "speculative_config", None):
        raise KvarnConfigError(f"--kv-cache-dtype {fmt.name} does not support speculative decoding yet; "
                               "drop --speculative-config or use another kv cache dtype")


def check_config_after(cfg) -> None:
    """On the built VllmConfig: model dtype and head size."""
    import torch

    name = cfg.cache_config.cache_dtype
    mc = cfg.model_config
    if mc is None:
        return
    dt = mc.dtype
    if dt not in (torch.float16, torch.bfloat16):
        raise KvarnConfigError(f"--kv-cache-dtype {name} runs with float16 or bfloat16 models, got {dt}; pass "
                               "--dtype float16 (or bfloat16)")
    try:
        hs = mc.get_head_size()
    except Exception:  # noqa: BLE001
        hs = None
    if hs is not None and hs not in SUPPORTED_HEAD_SIZES:
        raise KvarnConfigError(f"--kv-cache-dtype {name} serves head_dim {', '.join(map(str, SUPPORTED_HEAD_SIZES))}; "
                               f"this model has head_dim {hs}: use --kv-cache-dtype auto (or fp8) for it")
    if cfg.cache_config.block_size != get_format(name).group:
        raise KvarnConfigError(f"--kv-cache-dtype {name} needs --block-size {get_format(name).group}, vLLM settled "
                               f"on {cfg.cache_config.block_size}")
    fmt = get_format(name)
    # Each of these would let a request start mid-tile from blocks it did not write (its partial tile lives in a
    # per-request 16-bit tail), so attention would read stale tails: refuse them at start rather than serve wrong.
    if getattr(cfg, "kv_transfer_config", None):
        raise KvarnConfigError(f"--kv-cache-dtype {name} does not support KV transfer / offloading connectors yet; "
                               "drop --kv-transfer-config or use another kv cache dtype")
    unit = getattr(cfg.cache_config, "prefix_match_unit", None)
    if unit and unit % fmt.group:
        raise KvarnConfigError(f"--kv-cache-dtype {name} needs --prefix-match-unit to be a multiple of its "
                               f"{fmt.group}-token tile, got {unit}")
    # Micro-batching splits a step's rows over several metadata builds; the tail-slot map is per step (row 0 ..),
    # so a second micro-batch would read the first one's tails.
    pc = getattr(cfg, "parallel_config", None)
    if pc is not None and (getattr(pc, "enable_dbo", False) or (getattr(pc, "ubatch_size", 1) or 1) > 1):
        raise KvarnConfigError(f"--kv-cache-dtype {name} does not support micro-batching (--enable-dbo / "
                               "--ubatch-size) yet; drop it or use another kv cache dtype")
    # Sliding-window layers fall back to 16-bit pages; the hybrid KV cache manager would have to pool them with
    # KVarN pages, whose sizes are no multiple of each other (vLLM 0.26 kv_cache_utils: unify page sizes).
    sliding = getattr(mc, "get_sliding_window", lambda: None)()
    if sliding and not getattr(cfg.scheduler_config, "disable_hybrid_kv_cache_manager", False):
        raise KvarnConfigError(f"--kv-cache-dtype {name}: this model has sliding-window layers, which kvarn serves "
                               "16-bit and vLLM's hybrid KV cache manager cannot pool with KVarN pages; add "
                               "--disable-hybrid-kv-cache-manager (untested) or use another kv cache dtype")
    _once("summary", "kvarn: %s: %d B per (tile, KV head) = %d B per token per head (fp16: %d); tail buffer for "
          "%d requests", fmt.name, fmt.record_bytes(hs or 128), fmt.slot_bytes(hs or 128), 4 * (hs or 128),
          cfg.scheduler_config.max_num_seqs)


def wrap_create_engine_config(orig):
    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        if is_kvarn(getattr(self, "kv_cache_dtype", None)):
            check_args_before(self)
            cfg = orig(self, *args, **kwargs)
            check_config_after(cfg)
            return cfg
        return orig(self, *args, **kwargs)

    return _mark(create_engine_config)


# ---------------------------------------------------------------------------------------------------------------
# 5. worker: KV budget and tail slots


def kvarn_layers(vllm_config):
    """(name, layer) of every layer that will hold a KVarN cache (not KV-sharing, decoder, no sliding window)."""
    ctx = vllm_config.compilation_config.static_forward_context
    out = []
    for name, layer in ctx.items():
        if not is_kvarn(getattr(layer, "kv_cache_dtype", None)):
            continue
        if getattr(layer, "kv_sharing_target_layer_name", None) is not None:
            continue
        if getattr(layer, "sliding_window", None) is not None:
            continue
        out.append((name, layer))
    return out


def tail_reserve_bytes(vllm_config) -> int:
    layers = kvarn_layers(vllm_config)
    if not layers:
        return 0
    import torch

    slots = int(vllm_config.scheduler_config.max_num_seqs)
    itemsize = torch.empty((), dtype=vllm_config.model_config.dtype).element_size()
    total = 0
    for _, layer in layers:
        fmt = get_format(layer.kv_cache_dtype)
        total += tail_bytes(slots, layer.num_kv_heads, fmt.group, layer.head_size, itemsize, fmt.sink_tokens,
                            fmt.window_tokens)
    return total


def patch_worker() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    if not _wrapped(Worker, "determine_available_memory"):
        Worker.determine_available_memory = wrap_determine_available_memory(Worker.determine_available_memory)
    if not _wrapped(Worker, "init_device"):
        Worker.init_device = wrap_init_device(Worker.init_device)


def wrap_determine_available_memory(orig):
    @functools.wraps(orig)
    def determine_available_memory(self):
        avail = orig(self)
        reserve = tail_reserve_bytes(self.vllm_config)
        if not reserve:
            return avail
        left = int(avail) - reserve
        if left <= 0:
            raise KvarnConfigError(
                f"kvarn: the 16-bit tail buffer for max_num_seqs={self.vllm_config.scheduler_config.max_num_seqs} "
                f"needs {reserve / 2**30:.2f} GiB but only {avail / 2**30:.2f} GiB are free for the KV cache; lower "
                "--max-num-seqs or raise --gpu-memory-utilization")
        if hasattr(self, "available_kv_cache_memory_bytes"):
            self.available_kv_cache_memory_bytes = left
        logger.info("kvarn: reserved %.2f GiB of the KV budget for the 16-bit tail buffers (%d requests x %d layers); "
                    "%.2f GiB left for the paged KV cache", reserve / 2**30,
                    self.vllm_config.scheduler_config.max_num_seqs, len(kvarn_layers(self.vllm_config)), left / 2**30)
        return left

    return _mark(determine_available_memory)


def wrap_init_device(orig):
    @functools.wraps(orig)
    def init_device(self, *args, **kwargs):
        r = orig(self, *args, **kwargs)
        runner = getattr(self, "model_runner", None)
        if runner is not None and hook_runner_class(type(runner)) == "none":
            cache_cfg = getattr(getattr(self, "vllm_config", None), "cache_config", None)
            cache_dtype = getattr(cache_cfg, "cache_dtype", None)
            if is_kvarn(cache_dtype):  # without the per-step request rows every request would share one tail slot
                raise KvarnConfigError(
                    f"kvarn: unknown vLLM model runner {type(runner).__name__} (neither V2's prepare_attn nor V1's "
                    f"_update_states): --kv-cache-dtype {cache_dtype} needs vLLM {SUPPORTED_VLLM}x's runners; "
                    "set VLLM_USE_V2_MODEL_RUNNER=0 or 1, or serve with --kv-cache-dtype auto")
        return r

    return _mark(init_device)


def hook_runner_class(cls) -> str:
    """Install the per-step tail-slot hooks on a model-runner class; returns 'mrv1', 'mrv2' or 'none'."""
    if hasattr(cls, "prepare_attn") and hasattr(cls, "prepare_dummy_attn"):  # Model Runner V2
        if not _wrapped(cls, "prepare_attn"):
            cls.prepare_attn = _mrv2_prepare_attn(cls.prepare_attn)
            cls.prepare_dummy_attn = _dummy_wrapper(cls.prepare_dummy_attn)
        return "mrv2"
    if hasattr(cls, "_update_states"):  # Model Runner V1
        if not _wrapped(cls, "_update_states"):
            cls._update_states = _mrv1_update_states(cls._update_states)
            if hasattr(cls, "_dummy_run"):
                cls._dummy_run = _dummy_wrapper(cls._dummy_run, restore=True)
        return "mrv1"
    return "none"


def _mrv2_prepare_attn(orig):
    @functools.wraps(orig)
    def prepare_attn(self, input_batch):
        # the request's persistent RequestState index: stable for its life, < max_num_reqs = max_num_seqs
        # a prefilling row (new, or resumed: MRv2 re-prefills every token) makes the step "fresh" (no deferred flush)
        n = input_batch.num_reqs
        pre = getattr(input_batch, "is_prefilling_np", None)
        STEP.set_rows(input_batch.idx_mapping_np[:n], "mrv2", fresh=pre is None or bool(np.asarray(pre[:n]).any()))
        return orig(self, input_batch)

    return _mark(prepare_attn)


def _dummy_wrapper(orig, restore: bool = False):
    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        saved = (STEP.rows, STEP.source, STEP.fresh)
        STEP.set_dummy()
        try:
            return orig(self, *args, **kwargs)
        finally:
            if restore:
                STEP.set_rows(*saved)

    return _mark(wrapper)


def _mrv1_update_states(orig):
    @functools.wraps(orig)
    def _update_states(self, scheduler_output):
        r = orig(self, scheduler_output)
        table = STEP.table
        if table is None:
            table = STEP.table = SlotTable(int(self.vllm_config.scheduler_config.max_num_seqs))
        table.release(scheduler_output.finished_req_ids)
        table.release(getattr(scheduler_output, "preempted_req_ids", None) or ())
        batch = self.input_batch
        ids = list(batch.req_ids[: batch.num_reqs])
        # keep the slots of every request the runner still holds (scheduled or not): their tails must survive
        table.retain_only(list(getattr(self, "requests", {}).keys()) + ids)
        # new or resumed requests this step: no deferred flush (a prefix hit may read a block completed this step)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", None) if cached is not None else None
        fresh = bool(getattr(scheduler_output, "scheduled_new_reqs", True)) or resumed is None or bool(resumed)
        STEP.set_rows(table.rows(ids), "mrv1", fresh=fresh)
        return r

    return _mark(_update_states)
