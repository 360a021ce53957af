"""The vLLM plugin on CPU with vLLM absent or faked at its boundary: registration, dtype patching, routing, layer
fallback, KV spec arithmetic, config checks, the KV-budget reservation and the runner hooks."""
from __future__ import annotations

import dataclasses
import importlib
import sys
import types
import typing
from dataclasses import dataclass, fields, replace

import numpy as np
import pytest
import torch

from kvarn.capacity import DEFAULT_MAX_NUM_SEQS
from kvarn.formats import get_format, kvarn_formats
from kvarn.vllm_plugin import common, patches
from kvarn.vllm_plugin.tails import STEP, TAILS, SlotTable

# ---------------------------------------------------------------------------------------------------------------
# a fake vLLM 0.26 (only the names the plugin touches, with the same shapes and semantics)


def _mod(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def build_fake_vllm(version="0.26.0"):
    from pydantic.dataclasses import dataclass as pdataclass

    CacheDType = typing.Literal["auto", "float16", "bfloat16", "fp8", "turboquant_k8v4"]

    @pdataclass
    class CacheConfig:
        cache_dtype: CacheDType = "auto"
        block_size: int = 16
        sliding_window: int | None = None

    STR = {"float16": torch.float16, "fp8": torch.uint8}

    class Enum:
        CUSTOM = "CUSTOM"
        FLASH_ATTN = "FLASH_ATTN"

    overrides = {}

    def register_backend(backend, class_path=None, is_mamba=False):
        overrides[backend] = class_path

    def _get_backend_priorities(use_mla, device_capability, num_heads=None, kv_cache_dtype=None, use_non_causal=False):
        return [Enum.FLASH_ATTN]

    def _compute_kwargs(cls):
        return {}
    _compute_kwargs.cache_clear = lambda: _compute_kwargs.__dict__.__setitem__("cleared", True)

    @dataclass
    class EngineArgs:
        kv_cache_dtype: CacheDType = "auto"
        block_size: int | None = None
        max_num_seqs: int | None = None
        speculative_config: dict | None = None
        dtype: str = "float16"

        def create_engine_config(self, usage_context=None, headless=False):
            mc = types.SimpleNamespace(dtype=torch.float16 if self.dtype == "float16" else torch.float32,
                                       get_head_size=lambda: 64)
            return types.SimpleNamespace(
                cache_config=types.SimpleNamespace(cache_dtype=self.kv_cache_dtype, block_size=self.block_size or 16),
                model_config=mc, scheduler_config=types.SimpleNamespace(max_num_seqs=self.max_num_seqs or 1024))

    class Attention:
        def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, use_alibi_sqrt=None,
                     cache_config=None, quant_config=None, logits_soft_cap=None, per_layer_sliding_window=None,
                     prefix="", attn_type="decoder", kv_sharing_target_layer_name=None,
                     mm_prefix_clamp_sliding_window=False, attn_backend=None, head_size_v=None, **extra_impl_args):
            self.kv_cache_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
            self.num_kv_heads = num_kv_heads or num_heads
            self.head_size = head_size
            self.head_size_v = head_size_v or head_size
            self.sliding_window = per_layer_sliding_window
            self.attn_type = attn_type
            self.layer_name = prefix
            self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

        def get_kv_cache_spec(self, vllm_config):
            return "16-bit spec"

    class Worker:
        def __init__(self, vllm_config, avail):
            self.vllm_config = vllm_config
            self._avail = avail
            self.model_runner = None

        def determine_available_memory(self):
            self.available_kv_cache_memory_bytes = self._avail
            return self._avail

        def init_device(self):
            return None

    # the v1 attention interface (enough for backend.py)
    class AttentionBackend:
        pass

    class AttentionImpl:
        def __class_getitem__(cls, item):
            return cls

    class AttentionMetadataBuilder:
        def __class_getitem__(cls, item):
            return cls

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (
                kv_cache_spec, layer_names, vllm_config, device)

        def _init_reorder_batch_threshold(self, t=1, supports_spec_as_decode=False, supports_dcp_with_varlen=False):
            self.reorder_batch_threshold = t

    class AttentionCGSupport:  # values as in vLLM 0.26
        NEVER = 0
        UNIFORM_SINGLE_TOKEN_DECODE = 1

    class AttentionType:
        DECODER = "decoder"

    @dataclass(frozen=True, kw_only=True)
    class FullAttentionSpec:  # the real one's page arithmetic and merge (rebuilds cls(...) from base fields)
        block_size: int
        num_kv_heads: int
        head_size: int
        dtype: torch.dtype
        head_size_v: int | None = None
        page_size_padded: int | None = None

        @property
        def real_page_size_bytes(self):
            return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype.itemsize

        @property
        def page_size_bytes(self):
            return self.page_size_padded or self.real_page_size_bytes

        @classmethod
        def merge(cls, specs):
            m = cls(block_size=specs[0].block_size, num_kv_heads=specs[0].num_kv_heads,
                    head_size=specs[0].head_size, head_size_v=specs[0].head_size_v, dtype=specs[0].dtype)
            return m

    mods = {
        "vllm": _mod("vllm", __version__=version),
        "vllm.config": _mod("vllm.config", get_current_vllm_config=lambda: (_ for _ in ()).throw(RuntimeError())),
        "vllm.config.cache": _mod("vllm.config.cache", CacheDType=CacheDType, CacheConfig=CacheConfig),
        "vllm.utils": _mod("vllm.utils"),
        "vllm.utils.torch_utils": _mod("vllm.utils.torch_utils", STR_DTYPE_TO_TORCH_DTYPE=STR),
        "vllm.v1": _mod("vllm.v1"),
        "vllm.v1.attention": _mod("vllm.v1.attention"),
        "vllm.v1.attention.selector": _mod("vllm.v1.attention.selector", CacheDType=CacheDType),
        "vllm.v1.attention.backends": _mod("vllm.v1.attention.backends"),
        "vllm.v1.attention.backends.registry": _mod("vllm.v1.attention.backends.registry",
                                                    AttentionBackendEnum=Enum, register_backend=register_backend,
                                                    overrides=overrides),
        "vllm.v1.attention.backend": _mod("vllm.v1.attention.backend", AttentionBackend=AttentionBackend,
                                          AttentionCGSupport=AttentionCGSupport, AttentionImpl=AttentionImpl,
                                          AttentionMetadata=object, AttentionMetadataBuilder=AttentionMetadataBuilder,
                                          AttentionType=AttentionType, CommonAttentionMetadata=object),
        "vllm.v1.kv_cache_interface": _mod("vllm.v1.kv_cache_interface", FullAttentionSpec=FullAttentionSpec),
        "vllm.platforms": _mod("vllm.platforms"),
        "vllm.platforms.cuda": _mod("vllm.platforms.cuda", _get_backend_priorities=_get_backend_priorities),
        "vllm.engine": _mod("vllm.engine"),
        "vllm.engine.arg_utils": _mod("vllm.engine.arg_utils", EngineArgs=EngineArgs, CacheDType=CacheDType,
                                      _compute_kwargs=_compute_kwargs),
        "vllm.model_executor": _mod("vllm.model_executor"),
        "vllm.model_executor.layers": _mod("vllm.model_executor.layers"),
        "vllm.model_executor.layers.attention": _mod("vllm.model_executor.layers.attention"),
        "vllm.model_executor.layers.attention.attention": _mod("vllm.model_executor.layers.attention.attention",
                                                               Attention=Attention),
        "vllm.v1.worker": _mod("vllm.v1.worker"),
        "vllm.v1.worker.gpu_worker": _mod("vllm.v1.worker.gpu_worker", Worker=Worker),
    }
    return mods


@pytest.fixture
def fake_vllm(monkeypatch):
    mods = build_fake_vllm()
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, k)
    for k, m in mods.items():
        monkeypatch.setitem(sys.modules, k, m)
    import kvarn.vllm_plugin as plugin
    from kvarn.kernels import runtime

    monkeypatch.setattr(plugin, "_STATE", {"registered": False, "applied": [], "vllm_version": None, "pid": None})
    monkeypatch.setattr(runtime, "_CACHE_DIR", {"noted": False, "dir": None})  # register() notes the Triton cache
    monkeypatch.delitem(sys.modules, "kvarn.vllm_plugin.backend", raising=False)
    common._ACTIVE.clear()
    TAILS.clear()
    STEP.set_rows(None, "none")
    STEP.table = None
    yield types.SimpleNamespace(**{k.replace(".", "_"): m for k, m in mods.items()})
    sys.modules.pop("kvarn.vllm_plugin.backend", None)
    common._ACTIVE.clear()
    TAILS.clear()
    STEP.table = None


# ---------------------------------------------------------------------------------------------------------------


def test_plugin_entry_point(fake_vllm, monkeypatch):
    # pyproject's vllm.general_plugins entry point names register() (vLLM's VLLM_PLUGINS list can leave it out)
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["vllm.general_plugins"] == {"kvarn": "kvarn.vllm_plugin:register"}


def test_register_without_vllm_is_a_no_op(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    import kvarn.vllm_plugin as plugin

    monkeypatch.setattr(plugin, "_STATE", {"registered": False, "applied": [], "vllm_version": None, "pid": None})
    plugin.register()
    plugin.register()  # idempotent
    assert plugin.state()["applied"] == [] and plugin.state()["registered"]


def test_import_does_not_import_vllm():
    code = "import sys, kvarn, kvarn.vllm_plugin, kvarn.vllm_plugin.ops; assert 'vllm' not in sys.modules"
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


def test_other_vllm_version_warns_and_does_nothing(monkeypatch, caplog):
    mods = build_fake_vllm("0.25.1")
    for k, m in mods.items():
        monkeypatch.setitem(sys.modules, k, m)
    import kvarn.vllm_plugin as plugin

    monkeypatch.setattr(plugin, "_STATE", {"registered": False, "applied": [], "vllm_version": None, "pid": None})
    with caplog.at_level("WARNING", logger="vllm.kvarn"):
        plugin.register()
    assert plugin.state()["applied"] == []
    assert "0.25.1" in caplog.text
    assert "kvarn_k4v2_g128" not in typing.get_args(mods["vllm.config.cache"].CacheDType)


def test_register_applies_every_patch_idempotently(fake_vllm):
    import kvarn.vllm_plugin as plugin

    plugin.register()
    assert plugin.state()["applied"] == ["dtypes", "backend", "routing", "attention", "engine_args", "worker"]
    cache = fake_vllm.vllm_config_cache
    names = typing.get_args(cache.CacheDType)
    for f in kvarn_formats():
        assert f.name in names
        assert fake_vllm.vllm_utils_torch_utils.STR_DTYPE_TO_TORCH_DTYPE[f.name] is torch.uint8
    assert "turboquant_k8v4" in names and names[0] == "auto"
    # pydantic now accepts the new strings and still rejects unknown ones
    assert cache.CacheConfig(cache_dtype="kvarn_k4v2_g128").cache_dtype == "kvarn_k4v2_g128"
    with pytest.raises(Exception):
        cache.CacheConfig(cache_dtype="kvarn_k9v9_g128")
    assert fake_vllm.vllm_v1_attention_selector.CacheDType is cache.CacheDType
    au = fake_vllm.vllm_engine_arg_utils
    assert "kvarn_k2v2_g128" in typing.get_args({f.name: f for f in fields(au.EngineArgs)}["kv_cache_dtype"].type)
    assert au._compute_kwargs.__dict__.get("cleared")
    assert fake_vllm.vllm_v1_attention_backends_registry.overrides["CUSTOM"] == patches.BACKEND_PATH
    # second registration (e.g. after fork in the same pid) changes nothing
    prio = fake_vllm.vllm_platforms_cuda._get_backend_priorities
    init = fake_vllm.vllm_model_executor_layers_attention_attention.Attention.__init__
    plugin._STATE["registered"] = False
    plugin.register()
    patches.apply()
    assert fake_vllm.vllm_platforms_cuda._get_backend_priorities is prio
    assert fake_vllm.vllm_model_executor_layers_attention_attention.Attention.__init__ is init
    assert typing.get_args(cache.CacheDType).count("kvarn_k4v2_g128") == 1


def test_routing_only_touches_kvarn(fake_vllm):
    patches.apply()
    prio = fake_vllm.vllm_platforms_cuda._get_backend_priorities
    assert prio(False, None, 8, "kvarn_k4v2_g128") == ["CUSTOM"]
    assert prio(False, None, 8, "auto") == ["FLASH_ATTN"]
    assert prio(False, None, 8, "fp8") == ["FLASH_ATTN"]
    assert prio(True, None, 8, "kvarn_k4v2_g128") == ["FLASH_ATTN"]  # MLA: not ours


def test_layers_kvarn_cannot_serve_fall_back_to_16bit(fake_vllm, caplog):
    patches.apply()
    Attention = fake_vllm.vllm_model_executor_layers_attention_attention.Attention
    CC = fake_vllm.vllm_config_cache.CacheConfig
    cc = CC(cache_dtype="kvarn_k4v2_g128", block_size=128)
    ok = Attention(9, 64, 0.125, 3, cache_config=cc, prefix="model.layers.0.self_attn.attn")
    assert ok.kv_cache_dtype == "kvarn_k4v2_g128"
    with caplog.at_level("INFO", logger="vllm.kvarn"):
        sw = Attention(9, 64, 0.125, 3, None, None, cc, per_layer_sliding_window=4096, prefix="l1")
        sw2 = Attention(9, 64, 0.125, 3, cache_config=cc, per_layer_sliding_window=512, prefix="l2")
        cross = Attention(9, 64, 0.125, 3, cache_config=cc, attn_type="encoder_decoder", prefix="l3")
        odd = Attention(9, 96, 0.1, 3, cache_config=cc, prefix="l4")
        wide = Attention(8, 256, 0.0625, 2, cache_config=cc, prefix="l6")  # served (the GPU tests cover D=256)
    assert sw.kv_cache_dtype == sw2.kv_cache_dtype == cross.kv_cache_dtype == odd.kv_cache_dtype == "auto"
    assert wide.kv_cache_dtype == "kvarn_k4v2_g128"
    assert cc.cache_dtype == "kvarn_k4v2_g128"  # the shared config is untouched
    assert caplog.text.count("sliding-window") == 1  # said once
    plain = Attention(9, 64, 0.125, 3, cache_config=CC(cache_dtype="auto"), prefix="l5")
    assert plain.kv_cache_dtype == "auto"
    # the other reasons a layer keeps 16 bits, each said once however many layers have it
    patches._SAID.clear()
    caplog.clear()
    with caplog.at_level("INFO", logger="vllm.kvarn"):
        odd = [Attention(4, 64, .1, 2, alibi_slopes=[1.0] * 4, cache_config=cc),
               Attention(4, 64, .1, 2, alibi_slopes=[1.0] * 4, cache_config=cc),
               Attention(4, 64, .1, 2, logits_soft_cap=30.0, cache_config=cc),
               Attention(4, 64, .1, 2, cache_config=cc, sinks=torch.zeros(4)),
               Attention(4, 128, .1, 2, head_size_v=64, cache_config=cc)]
    assert all(x.kv_cache_dtype == "auto" for x in odd)
    for reason in ("ALiBi", "soft-capping", "attention sinks", "value head_dim 64 != key head_dim 128"):
        assert caplog.text.count(reason) == 1, reason


def test_spec_has_true_page_bytes_and_merge_keeps_it(fake_vllm):
    patches.apply()
    Attention = fake_vllm.vllm_model_executor_layers_attention_attention.Attention
    CC = fake_vllm.vllm_config_cache.CacheConfig
    vc = types.SimpleNamespace(cache_config=CC(cache_dtype="kvarn_k4v2_g128", block_size=128))
    layer = Attention(9, 64, 0.125, 3, cache_config=vc.cache_config, prefix="l0")
    spec = layer.get_kv_cache_spec(vc)
    fmt = get_format("kvarn_k4v2_g128")
    assert spec.dtype is torch.uint8 and spec.block_size == 128
    assert spec.page_size_bytes == 3 * fmt.record_bytes(64)
    assert spec.page_size_bytes == 128 * 3 * fmt.slot_bytes(64)  # = tokens x heads x capacity-model bytes
    merged = type(spec).merge([spec, replace(spec)])
    assert merged.page_size_bytes == spec.page_size_bytes and merged.kvarn_format == "kvarn_k4v2_g128"
    with pytest.raises(ValueError, match="--block-size 128"):
        layer.get_kv_cache_spec(types.SimpleNamespace(cache_config=CC(cache_dtype="kvarn_k4v2_g128", block_size=16)))
    sixteen = Attention(9, 64, 0.125, 3, cache_config=CC(cache_dtype="auto"), prefix="l1")
    assert sixteen.get_kv_cache_spec(vc) == "16-bit spec"
    with pytest.raises(ValueError, match="same format"):
        type(spec).merge([spec, replace(spec, kvarn_format="kvarn_k4v4_g128", kvarn_record_bytes=1)])
    # shape independent of cache_dtype_str, and sized exactly like the page
    from kvarn.vllm_plugin.backend import KvarnAttentionBackend as B

    for cds in ("auto", "kvarn_k4v2_g128"):
        shape = B.get_kv_cache_shape(7, 128, 3, 64, cache_dtype_str=cds)
        assert shape == (7, 3, fmt.record_bytes(64))
        assert np.prod(shape) == 7 * spec.page_size_bytes
    assert B.get_name() == "CUSTOM" and B.get_supported_kernel_block_sizes() == [128]
    assert B.supports_kv_cache_dtype("kvarn_k2v2_g128") and not B.supports_kv_cache_dtype("fp8")
    assert B.get_supported_head_sizes() == [64, 128, 256]
    # every preset at D=128 (8 KV heads: Qwen3-8B's per-rank heads at TP 1; at TP 2 each rank gets 4 and the same
    # per-head record): the page is heads x record bytes, the tile's tokens x the capacity model's bytes per token
    for f in kvarn_formats():
        vc_f = types.SimpleNamespace(cache_config=CC(cache_dtype=f.name, block_size=f.block_size))
        for heads in (8, 4):
            sp = Attention(4 * heads, 128, 0.088, heads, cache_config=vc_f.cache_config,
                           prefix=f"{f.name}.{heads}").get_kv_cache_spec(vc_f)
            assert sp.page_size_bytes == heads * f.record_bytes(128) == f.group * heads * f.slot_bytes(128), f.name


def test_config_checks_name_the_fix(fake_vllm, monkeypatch):
    patches.apply()
    EA = fake_vllm.vllm_engine_arg_utils.EngineArgs
    cfg = EA(kv_cache_dtype="kvarn_k4v2_g128").create_engine_config()
    assert cfg.cache_config.block_size == 128 and cfg.scheduler_config.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    cfg = EA(kv_cache_dtype="kvarn_k4v2_g64", max_num_seqs=32).create_engine_config()
    assert cfg.cache_config.block_size == 64 and cfg.scheduler_config.max_num_seqs == 32
    with pytest.raises(ValueError, match="--block-size 128"):
        EA(kv_cache_dtype="kvarn_k4v2_g128", block_size=16).create_engine_config()
    with pytest.raises(ValueError, match="--dtype float16"):
        EA(kv_cache_dtype="kvarn_k4v2_g128", dtype="float32").create_engine_config()
    # a model whose head_dim has no kernels: every layer would fall back, so the start fails naming the fix
    orig = EA.create_engine_config.__wrapped__
    for hs in (96, 80):
        def with_head(self, *a, hs=hs, **k):
            c = orig(self, *a, **k)
            c.model_config.get_head_size = lambda: hs
            return c

        with monkeypatch.context() as m:
            m.setattr(EA, "create_engine_config", patches.wrap_create_engine_config(with_head))
            with pytest.raises(ValueError, match=f"head_dim {hs}: use --kv-cache-dtype auto"):
                EA(kv_cache_dtype="kvarn_k4v2_g128").create_engine_config()
    with pytest.raises(ValueError, match="speculative"):
        EA(kv_cache_dtype="kvarn_k4v2_g128", speculative_config={"n": 1}).create_engine_config()
    # what would let a request start mid-tile from blocks it did not write is refused at start
    from kvarn.vllm_plugin.patches import check_config_after

    def built(**extra):
        c = EA(kv_cache_dtype="kvarn_k4v2_g128").create_engine_config()
        for k, v in extra.items():
            obj, attr = k.split("__")
            setattr(getattr(c, obj) if obj != "cfg" else c, attr, v)
        return c

    with pytest.raises(ValueError, match="--kv-transfer-config"):
        check_config_after(built(cfg__kv_transfer_config={"kv_connector": "x"}))
    with pytest.raises(ValueError, match="--prefix-match-unit.*got 16"):
        check_config_after(built(cache_config__prefix_match_unit=16))
    check_config_after(built(cache_config__prefix_match_unit=256))
    with pytest.raises(ValueError, match="sliding-window"):
        check_config_after(built(model_config__get_sliding_window=lambda: 4096))
    check_config_after(built(model_config__get_sliding_window=lambda: 4096,
                             scheduler_config__disable_hybrid_kv_cache_manager=True))
    cfg_dbo = built()
    cfg_dbo.parallel_config = types.SimpleNamespace(enable_dbo=True, ubatch_size=1)
    with pytest.raises(ValueError, match="micro-batching"):
        check_config_after(cfg_dbo)
    # other dtypes untouched
    cfg = EA(kv_cache_dtype="fp8").create_engine_config()
    assert cfg.cache_config.block_size == 16 and cfg.scheduler_config.max_num_seqs == 1024


def _vllm_config(layers, max_num_seqs=8, dtype=torch.float16):
    return types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(static_forward_context=layers),
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=types.SimpleNamespace(dtype=dtype),
        cache_config=types.SimpleNamespace(cache_dtype="kvarn_k4v2_g128", block_size=128))


def test_kv_budget_reserves_the_tail_buffers(fake_vllm):
    patches.apply()
    L = lambda dt, sw=None, share=None: types.SimpleNamespace(kv_cache_dtype=dt, num_kv_heads=3, head_size=64,
                                                              sliding_window=sw, kv_sharing_target_layer_name=share)
    layers = {"a": L("kvarn_k4v2_g128"), "b": L("kvarn_k4v2_g128"), "c": L("auto"),
              "d": L("kvarn_k4v2_g128", share="a")}
    vc = _vllm_config(layers, max_num_seqs=8)
    W = fake_vllm.vllm_v1_worker_gpu_worker.Worker
    per_layer = 2 * 9 * 3 * (128 + 16 + 2 * 32) * 64 * 2  # K+V, (8 + scratch) slots, tile + sink + window rows, fp16
    w = W(vc, 10**9)
    assert w.determine_available_memory() == 10**9 - 2 * per_layer
    assert w.available_kv_cache_memory_bytes == 10**9 - 2 * per_layer
    assert W(_vllm_config({"c": L("auto")}), 10**9).determine_available_memory() == 10**9
    with pytest.raises(ValueError, match="--max-num-seqs"):
        W(vc, per_layer).determine_available_memory()


def test_runner_hooks_map_rows_to_tail_slots(fake_vllm):
    patches.apply()

    class MRv1:
        def __init__(self):
            self.vllm_config = _vllm_config({}, max_num_seqs=4)
            self.requests = {}
            self.input_batch = types.SimpleNamespace(req_ids=[], num_reqs=0)

        def _update_states(self, so):
            for r in so.finished_req_ids:
                self.requests.pop(r, None)
            self.requests.update({r: 1 for r in so.batch})
            self.input_batch.req_ids = list(so.batch) + [None]
            self.input_batch.num_reqs = len(so.batch)

        def _dummy_run(self, n):
            return STEP.rows_for(2, scratch=4).tolist()

    assert patches.hook_runner_class(MRv1) == "mrv1"
    assert patches.hook_runner_class(MRv1) == "mrv1"  # idempotent
    r = MRv1()
    so = lambda batch, fin=(), pre=None: types.SimpleNamespace(batch=batch, finished_req_ids=set(fin),
                                                                preempted_req_ids=set(pre) if pre else None)
    r._update_states(so(["a", "b"]))
    assert STEP.rows.tolist() == [0, 1] and STEP.source == "mrv1"
    r._update_states(so(["b", "a", "c"]))  # reordered batch: slots follow the request, not the row
    assert STEP.rows.tolist() == [1, 0, 2]
    r._update_states(so(["c", "d"], fin=["a"], pre=["b"]))
    assert STEP.rows.tolist() == [2, 0]
    assert r._dummy_run(3) == [4, 4]  # dummy runs use the scratch slot ...
    assert STEP.rows.tolist() == [2, 0]  # ... and restore the step's rows
    # "fresh" steps (a new or resumed request: no deferred flush); unknown scheduler output fields count as fresh
    assert STEP.fresh
    cached = lambda resumed: types.SimpleNamespace(resumed_req_ids=set(resumed))  # noqa: E731
    for new, resumed, fresh in (([], [], False), (["e"], [], True), ([], ["c"], True)):
        out = so(["c", "d"])
        out.scheduled_new_reqs, out.scheduled_cached_reqs = new, cached(resumed)
        r._update_states(out)
        assert STEP.fresh is fresh, (new, resumed)
    r._update_states(types.SimpleNamespace(**vars(so(["c", "d"])), scheduled_new_reqs=[],
                                           scheduled_cached_reqs=cached([])))
    r._dummy_run(3)
    assert STEP.fresh is False  # restored with the rows

    class MRv2:
        def prepare_attn(self, input_batch):
            return STEP.rows.tolist()

        def prepare_dummy_attn(self, input_batch):
            return STEP.rows

    assert patches.hook_runner_class(MRv2) == "mrv2"
    ib = types.SimpleNamespace(idx_mapping_np=np.array([7, 3, 5], dtype=np.int32), num_reqs=2)
    assert MRv2().prepare_attn(ib) == [7, 3] and STEP.fresh  # no prefill flags: fresh
    ib.is_prefilling_np = np.array([False, False, True])  # the third row is past num_reqs
    MRv2().prepare_attn(ib)
    assert STEP.fresh is False
    ib.is_prefilling_np = np.array([False, True, False])  # a new or resumed request prefills
    MRv2().prepare_attn(ib)
    assert STEP.fresh is True
    assert MRv2().prepare_dummy_attn(ib) is None

    # a runner with neither hook: a KVarN engine stops at start (every request would share the scratch tail slot);
    # other dtypes are untouched
    class Worker:
        def __init__(self, dtype):
            self.vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(cache_dtype=dtype))

        def init_device(self):
            self.model_runner = type("FutureRunner", (), {})()

    init = patches.wrap_init_device(Worker.init_device)
    with pytest.raises(patches.KvarnConfigError, match="unknown vLLM model runner FutureRunner"):
        init(Worker("kvarn_k4v2_g128"))
    init(Worker("auto"))


def _g64_backend(be):
    """The g64 preset made active, its layer spec (2 KV heads, head_dim 64) and a 4-sequence fp32 vLLM config."""
    fmt = get_format("kvarn_k4v2_g64")
    common.set_active_format(fmt.name)
    spec = be.KvarnAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                                 kvarn_format=fmt.name, kvarn_group=64, kvarn_record_bytes=fmt.record_bytes(64))
    vc = _vllm_config({}, max_num_seqs=4, dtype=torch.float32)
    vc.cache_config.cache_dtype = fmt.name
    return fmt, spec, vc


def test_builder_and_impl_run_a_step_on_cpu(fake_vllm, monkeypatch):
    patches.apply()
    from kvarn.vllm_plugin import backend as be

    fmt, spec, vc = _g64_backend(be)
    b = be.KvarnMetadataBuilder(spec, ["l0"], vc, torch.device("cpu"))
    b2 = be.KvarnMetadataBuilder(spec, ["l0"], vc, torch.device("cpu"))  # a second builder shares the buffers
    assert b2.slots == 4 and TAILS.get("l0")[0].shape == (5, 2, 64 + 16 + 2 * 16, 64)  # tile, sink, window halves
    STEP.set_rows(np.array([2], dtype=np.int32), "mrv2")
    cm = types.SimpleNamespace(num_reqs=1, num_actual_tokens=70, query_start_loc_cpu=torch.tensor([0, 70]),
                               seq_lens=torch.tensor([70], dtype=torch.int32), seq_lens_cpu_upper_bound=torch.tensor([70]),
                               block_table_tensor=torch.tensor([[5, 6]], dtype=torch.int32),
                               slot_mapping=torch.arange(70))
    md = b.build(0, cm)
    impl = be.KvarnAttentionImpl(4, 64, 0.125, 2, None, None, fmt.name)
    cache = torch.zeros(8, 2, fmt.record_bytes(64), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(72, h, 64, generator=g) for h in (4, 2, 2))
    out = torch.zeros(72, 4 * 64)
    layer = types.SimpleNamespace(layer_name="l0")
    impl.forward(layer, q, k, v, cache, md, output=out)
    assert cache[5].any() and not cache[6].any()  # tile 0 stored, tile 1 unfinished
    assert torch.equal(TAILS.get("l0")[0][2, :, :6], k[64:70].transpose(0, 1))
    assert out[:70].abs().sum() > 0 and not out[70:].any()
    assert impl.forward(layer, q, k, v, cache, None, output=out.fill_(1)).abs().sum() == 0  # profiling run
    assert not md.plan.decode_only
    # a decode step (+ one graph-padding row): the fast path; tail slots in the builder's persistent buffer
    cm2 = types.SimpleNamespace(num_reqs=2, num_actual_tokens=2, query_start_loc_cpu=torch.tensor([0, 1, 1]),
                                seq_lens=torch.tensor([71, 0], dtype=torch.int32),
                                seq_lens_cpu_upper_bound=torch.tensor([71, 0]),
                                block_table_tensor=torch.tensor([[5, 6], [0, 0]], dtype=torch.int32),
                                slot_mapping=torch.tensor([70, -1]))
    md2 = b.build(0, cm2)
    assert md2.plan.decode_only and md2.plan.tail_slots.tolist() == [2, 4]  # padding row -> scratch slot (S = 4)
    assert md2.plan.tail_slots.data_ptr() == md.plan.tail_slots.data_ptr()  # same address every step (graph replay)
    out2 = torch.full((2, 4 * 64), float("nan"))
    impl.forward(layer, q[70:72], k[70:72], v[70:72], cache, md2, output=out2)
    assert torch.equal(TAILS.get("l0")[0][2, :, 6], k[70]) and out2[0].isfinite().all()
    # full-graph decode is declared to vLLM, and KVARN_FULL_GRAPH=0 takes it back
    assert be.KvarnMetadataBuilder.get_cudagraph_support(vc, spec) == 1
    from kvarn import settings

    monkeypatch.setenv("KVARN_FULL_GRAPH", "0")
    settings.reload()
    assert be.KvarnMetadataBuilder.get_cudagraph_support(vc, spec) == 0


def test_builder_defers_the_flush_and_flushes_at_the_next_build(fake_vllm, monkeypatch):
    """KVARN_DEFER_FLUSH through the builder and impl (kernels through the interpreter): a decode step completing a
    tile leaves its record unwritten and the next build writes it, as the immediate path would; a "fresh" step (a
    new or resumed request) does not defer."""
    import functools

    patches.apply()
    from kvarn.vllm_plugin import backend as be
    from kvarn.vllm_plugin import ops

    monkeypatch.setattr(ops, "decode_step", functools.partial(ops.decode_step, use_kernels=True))
    fmt, spec, vc = _g64_backend(be)
    layer = types.SimpleNamespace(layer_name="ld")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(130, h, 64, generator=g) for h in (4, 2, 2))
    caches = {}
    for defer in (False, True):
        TAILS.clear()
        b = be.KvarnMetadataBuilder(spec, ["ld"], vc, torch.device("cpu"))
        b._decode_kernels, b._defer = True, defer  # as on a GPU with KVARN_DEFER_FLUSH=1 (or not)
        impl = be.KvarnAttentionImpl(4, 64, 0.125, 2, None, None, fmt.name)  # (it keeps its layer's tails)
        cache = torch.zeros(8, 2, fmt.record_bytes(64), dtype=torch.uint8)
        STEP.set_rows(np.array([1], dtype=np.int32), "mrv2", fresh=True)
        cm = types.SimpleNamespace(num_reqs=1, num_actual_tokens=127, query_start_loc_cpu=torch.tensor([0, 127]),
                                   seq_lens=torch.tensor([127], dtype=torch.int32),
                                   seq_lens_cpu_upper_bound=torch.tensor([127]),
                                   block_table_tensor=torch.tensor([[5, 6, 7]], dtype=torch.int32),
                                   slot_mapping=torch.arange(127))
        impl.forward(layer, q[:127], k[:127], v[:127], cache, b.build(0, cm), output=torch.zeros(127, 256))
        assert cache[5].any() and not cache[6].any()
        dec = lambda s: types.SimpleNamespace(  # noqa: E731 - one decode token at position s - 1
            num_reqs=1, num_actual_tokens=1, query_start_loc_cpu=torch.tensor([0, 1]),
            seq_lens=torch.tensor([s], dtype=torch.int32), seq_lens_cpu_upper_bound=torch.tensor([s]),
            block_table_tensor=torch.tensor([[5, 6, 7]], dtype=torch.int32), slot_mapping=torch.tensor([s - 1]))
        STEP.set_rows(np.array([1], dtype=np.int32), "mrv2", fresh=False)
        md = b.build(0, dec(128))  # this token completes tile 1
        assert (md.plan.defer is not False) is defer and (not defer or md.plan.defer.item() == 1)
        out = torch.zeros(1, 256)
        impl.forward(layer, q[127:128], k[127:128], v[127:128], cache, md, output=out)
        assert out.isfinite().all() and out.abs().sum() > 0
        assert bool(cache[6].any()) is not defer  # deferred: the record is not written yet
        STEP.set_rows(np.array([1], dtype=np.int32), "mrv2", fresh=True)
        md = b.build(0, dec(129))  # the next build flushes; a fresh step does not defer (flag 0 on the device)
        assert cache[6].any() and (md.plan.defer is False or md.plan.defer.item() == 0)
        impl.forward(layer, q[128:129], k[128:129], v[128:129], cache, md, output=torch.zeros(1, 256))
        caches[defer] = cache
    assert torch.equal(caches[False], caches[True])
    TAILS.clear()


def test_register_notes_the_triton_cache_before_vllm_moves_it(fake_vllm, monkeypatch):
    from kvarn.kernels import runtime
    import kvarn.vllm_plugin as plugin

    monkeypatch.setenv("TRITON_CACHE_DIR", "/home/user/.triton/cache")
    plugin.register()
    assert runtime._CACHE_DIR == {"noted": True, "dir": "/home/user/.triton/cache"}
