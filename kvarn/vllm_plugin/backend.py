"""The KVarN attention backend for vLLM 0.26 (registered as AttentionBackendEnum.CUSTOM). Imports vLLM: loaded by
vLLM through the registry path, never by `import kvarn`.

Cache layout per layer: uint8 `(num_blocks, num_kv_heads, record_bytes(D))`, block = tile (docs/format.md); the
shape never depends on `cache_dtype_str` (MRv1 passes "auto" for unknown quant modes). The unfinished tile of each
request lives in the 16-bit tail buffers (tails.py), reserved from the KV budget by the worker patch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ..formats import get_format
from ..method.paged import host_tensor
from . import ops, step_plan
from .step_plan import StepPlan
from .common import SUPPORTED_HEAD_SIZES, active_format, defer_flush_enabled, is_kvarn, kvarn_dtype_names
from .tails import STEP, TAILS

logger = logging.getLogger("vllm.kvarn")


@dataclass(frozen=True, kw_only=True)
class KvarnAttentionSpec(FullAttentionSpec):
    """FullAttentionSpec whose page is the true KVarN bytes: (block / g) x num_kv_heads x record_bytes(D)."""

    kvarn_format: str = ""
    kvarn_group: int = 0
    kvarn_record_bytes: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        if not self.kvarn_group:
            return super().real_page_size_bytes
        return (self.block_size // self.kvarn_group) * self.num_kv_heads * self.kvarn_record_bytes

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)
        first = specs[0]
        for s in specs[1:]:
            if (s.kvarn_format, s.kvarn_group, s.kvarn_record_bytes) != (
                    first.kvarn_format, first.kvarn_group, first.kvarn_record_bytes):
                raise ValueError("kvarn: all KVarN layers of one KV cache group must use the same format")
        return replace(merged, kvarn_format=first.kvarn_format, kvarn_group=first.kvarn_group,
                       kvarn_record_bytes=first.kvarn_record_bytes)


def make_spec(layer, block_size: int) -> KvarnAttentionSpec:
    fmt = get_format(layer.kv_cache_dtype)
    if block_size != fmt.group:
        raise ValueError(f"kvarn: --kv-cache-dtype {fmt.name} needs --block-size {fmt.group} (one block = one tile), "
                         f"vLLM uses block size {block_size}")
    return KvarnAttentionSpec(
        block_size=block_size,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        head_size_v=layer.head_size_v,
        dtype=torch.uint8,
        kvarn_format=fmt.name,
        kvarn_group=fmt.group,
        kvarn_record_bytes=fmt.record_bytes(layer.head_size),
    )


@dataclass
class KvarnMetadata(AttentionMetadata):
    plan: StepPlan
    num_actual_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor


def full_graph_decode_enabled() -> bool:
    """KVARN_FULL_GRAPH=0 turns full-graph decode off (attention then runs eagerly between piecewise graphs)."""
    from .. import settings

    return bool(settings.get("KVARN_FULL_GRAPH"))


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    # Pure decode steps (one token per request) run as one full CUDA graph: their store and attention read only
    # device tensors at fixed addresses (seq_lens, block table, the persistent tail-slot buffer below). Mixed /
    # prefill steps keep attention eager between piecewise graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # the torch fallback (no kernels) reads host data per step: it must never be captured
        if not full_graph_decode_enabled() or not ops.decode_kernels_available():
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        name = getattr(kv_cache_spec, "kvarn_format", "") or vllm_config.cache_config.cache_dtype
        self.fmt = get_format(name) if is_kvarn(name) else active_format()
        self.slots = int(vllm_config.scheduler_config.max_num_seqs)
        dtype = vllm_config.model_config.dtype
        TAILS.allocate(layer_names, self.slots, kv_cache_spec.num_kv_heads, self.fmt.group, kv_cache_spec.head_size,
                       dtype, device, sink=self.fmt.sink_tokens, window=self.fmt.window_tokens)
        # rows of a (padded) batch can exceed max_num_seqs: graph capture sizes go up to max_num_batched_tokens
        sched = vllm_config.scheduler_config
        cap = max(self.slots, int(getattr(sched, "max_num_batched_tokens", 0) or 0),
                  int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0)) + 1
        self._tail_slots = torch.full((cap,), self.slots, dtype=torch.int32, device=device)
        # the sink: per tail slot, the first block of the request whose first tokens its sink rows hold, and the
        # per-row count of sink rows a step may read (step_plan.update_sink_lens; persistent: graph replays read it)
        self._sink_tags = TAILS.sink_tags(layer_names, self.slots, device)
        self._sink_lens = torch.zeros(cap, dtype=torch.int32, device=device)
        # the window: per slot and half, the block of the tile whose last tokens it holds (update_window_lens)
        self._win_tags = TAILS.window_tags(layer_names, self.slots, device)
        self._win_lens = torch.zeros(cap, dtype=torch.int32, device=device)
        self._decode_kernels = torch.device(device).type == "cuda" and ops.decode_kernels_available()
        # the deferred flush (KVARN_DEFER_FLUSH=1) needs the decode kernels and exact host seq_lens (no drafts)
        self._layer_names = list(layer_names)
        self._defer = (defer_flush_enabled() and self._decode_kernels
                       and getattr(vllm_config, "speculative_config", None) is None)
        self._pending = TAILS.pending(layer_names, cap, device)
        if self._decode_kernels:  # compiles what prefill steps launch, and syncs: before any graph capture
            from .warmup import warm_up

            for hq, hk in _head_counts(vllm_config, layer_names, kv_cache_spec):
                warm_up(hk, hq, kv_cache_spec.head_size, dtype, self.fmt, device, defer=self._defer)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvarnMetadata:
        cm = common_attn_metadata
        # tiles the last (deferred) decode step completed: every layer's records written now, enqueued before this
        # step's forward, which may overwrite those tail rows
        if self._pending.n:
            self._pending.flush(TAILS.layer_buffers(self._layer_names), self.fmt)
        R = cm.num_reqs
        seq_cpu = cm.seq_lens_cpu_upper_bound
        if seq_cpu is None:
            seq_cpu = cm._seq_lens_cpu
        if seq_cpu is None:
            seq_cpu = cm.seq_lens[:R].cpu()  # host sync; only when a runner gives no CPU copy
        rows = STEP.rows_for(R, scratch=self.slots)
        rows = np.where((rows >= 0) & (rows <= self.slots), rows, self.slots).astype(np.int32)
        if R > self._tail_slots.shape[0]:  # not expected (see __init__); eager steps only
            self._tail_slots = torch.full((R + 1,), self.slots, dtype=torch.int32, device=self.device)
        # pinned source (no wait for the queued work); the plan's tail_slots is this view of the persistent buffer
        # (same address every step: graph replays)
        self._tail_slots[:R].copy_(host_tensor(rows, np.int32, self.device), non_blocking=True)
        plan = step_plan.plan_step(cm.query_start_loc_cpu, np.asarray(seq_cpu), R, rows, cm.block_table_tensor,
                                   self.fmt.group, self.device, decode_minimal=self._decode_kernels,
                                   tail_slots_dev=self._tail_slots[:R], sink=self.fmt.sink_tokens,
                                   window=self.fmt.window_tokens)
        if R > self._sink_lens.shape[0]:  # as _tail_slots above
            self._sink_lens = torch.zeros(R + 1, dtype=torch.int32, device=self.device)
        if R > self._win_lens.shape[0]:
            self._win_lens = torch.zeros(R + 1, dtype=torch.int32, device=self.device)
        # a decode-only step's bookkeeping is one kernel launch reading the decode kernels' device seq_lens
        step_plan.update_lens(plan, self._sink_tags, self._win_tags, cm.block_table_tensor, self._sink_lens,
                              self._win_lens, seq_lens_dev=cm.seq_lens if self._decode_kernels else None)
        if self._defer and plan.decode_only:
            # not in a step that schedules a new or resumed request: its prefix hit may read a block another row
            # completes in this very step (vLLM caches blocks as it schedules them). The flag is device data, so
            # the decode graph (captured with it, in a dummy "fresh" step) defers exactly when it is 1.
            want = 0 if STEP.fresh else 1
            plan.defer = self._pending.set_flag(want)
            if want:
                self._pending.note(np.asarray(seq_cpu)[:R], rows, cm.block_table_tensor, self.fmt.group,
                                   scratch=self.slots)
        return KvarnMetadata(plan=plan, num_actual_tokens=cm.num_actual_tokens, block_table=cm.block_table_tensor,
                             seq_lens=cm.seq_lens, slot_mapping=cm.slot_mapping)


_FA: dict[int, tuple | None] = {}


def flash_varlen(head_size: int) -> tuple | None:
    """(vLLM's flash_attn_varlen_func, its FA version) for this head size, or None where it is unavailable (then
    first and continuation chunks use the torch varlen); looked up once."""
    if head_size not in _FA:
        _FA[head_size] = None
        try:
            from vllm.v1.attention.backends.fa_utils import (
                flash_attn_varlen_func,
                get_flash_attn_version,
                is_flash_attn_varlen_func_available,
            )

            if is_flash_attn_varlen_func_available():
                _FA[head_size] = (flash_attn_varlen_func, get_flash_attn_version(head_size=head_size))
        except Exception as e:  # noqa: BLE001
            logger.warning("kvarn: FlashAttention varlen unavailable (%s); first chunks use the torch path", e)
    return _FA[head_size]


def _head_counts(vllm_config, layer_names, kv_cache_spec) -> set[tuple[int, int]]:
    """(query heads, KV heads) per rank of this group's layers, as their forwards see them (a model may vary them
    per layer); the model config's counts where the layers are not reachable."""
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    found = {(int(layer.num_heads), int(layer.num_kv_heads)) for name in layer_names
             if (layer := ctx.get(name)) is not None and hasattr(layer, "num_heads") and hasattr(layer, "num_kv_heads")}
    return found or {(vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config),
                      kv_cache_spec.num_kv_heads)}


class KvarnAttentionImpl(AttentionImpl[KvarnMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, **kwargs):
        if alibi_slopes is not None:
            raise NotImplementedError("kvarn: ALiBi is not supported")
        if sliding_window is not None:
            raise NotImplementedError("kvarn: sliding-window layers stay 16-bit (the plugin routes them elsewhere)")
        if logits_soft_cap:
            raise NotImplementedError("kvarn: logits soft-capping is not supported")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("kvarn: only decoder self-attention is supported")
        if not is_kvarn(kv_cache_dtype):
            raise NotImplementedError(f"kvarn backend got kv_cache_dtype={kv_cache_dtype!r}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.fmt = get_format(kv_cache_dtype)
        self._tails = None

    def _raw_varlen(self):
        found = flash_varlen(self.head_size)
        if found is None:
            return None
        (fa, ver), scale = found, self.scale

        def run(q, k, v, cu, max_len, cu_k=None, max_k=None, out=None):
            # causal varlen; with cu_k the queries are the last q_len of each segment's keys (bottom-right causal).
            # Row-strided views (the raw K/V are views of the qkv projection) go in as they are: FlashAttention
            # takes row strides, and copies only a view whose last dim is strided. out: vLLM's fork (a version)
            # writes there; upstream flash-attn (no version) takes no out= and returns new rows (ops copies them in)
            kw = {} if ver is None else {"fa_version": ver, "out": out}
            return fa(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu if cu_k is None else cu_k,
                      max_seqlen_q=max_len, max_seqlen_k=max_len if max_k is None else max_k,
                      softmax_scale=scale, causal=True, **kw)

        return run

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        assert output is not None, "kvarn: output buffer required"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvarn: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        if self._tails is None:
            self._tails = TAILS.get(layer.layer_name if self.kv_sharing_target_layer_name is None
                                    else self.kv_sharing_target_layer_name)
        tail_k, tail_v = self._tails
        # for the deferred flush's one launch over every layer (a layer sharing another's cache: None)
        TAILS.register_cache(layer.layer_name, kv_cache if self.kv_sharing_target_layer_name is None else None)
        plan = attn_metadata.plan
        if plan.num_tokens == 0:
            return output
        out = output.view(-1, self.num_heads, self.head_size)
        write_kv = key is not None and value is not None and self.kv_sharing_target_layer_name is None
        if plan.decode_only:
            ops.decode_step(plan, query, key, value, out, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens,
                            plan.tail_slots, tail_k, tail_v, self.fmt, self.scale, write_kv=write_kv,
                            raw_varlen=self._raw_varlen())
            return output
        if write_kv:
            ops.store(plan, key, value, kv_cache, tail_k, tail_v, self.fmt)
        ops.attention(plan, query, key, value, out, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens,
                      tail_k, tail_v, self.fmt, self.scale, raw_varlen=self._raw_varlen())
        return output


class KvarnAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True  # the store runs first inside forward()
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(kvarn_dtype_names())

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return KvarnAttentionImpl

    @staticmethod
    def get_builder_cls():
        return KvarnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [active_format().group]

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        # independent of cache_dtype_str on purpose (MRv1 passes "auto")
        return (num_blocks, num_kv_heads, active_format().record_bytes(head_size))

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or is_kvarn(kv_cache_dtype)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
