"""`kvarn profile` on CPU: kernel categories, byte floors, trace aggregation, the plan hook, the CLI's error."""
import importlib.util
import json

import numpy as np
import pytest
import torch

from kvarn.bench import profile as P
from kvarn.formats import get_format
from kvarn.shapes import resolve_model
from tests.helpers import run_cli

# Kernel names as the profiler reports them on an H200 (vLLM 0.26 C++/Triton kernels, cuBLAS/FA3, ours)
KERNELS = [
    ("_store_tiles_kernel", None, "kv_store"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>"
     "(__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, __nv_bfloat16*, long const*, int, int, int)",
     None, "kv_store"),
    ("records_kernel", "kvarn::attention[decode]", "kvarn_decode"),
    ("_dequant_kernel", "kvarn::attention[prefill]", "kvarn_prefill"),
    ("merge_kernel", None, "kvarn_decode"),
    ("_decode_tail_kernel", "kvarn::store", "kvarn_tail"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_put_kernel_impl"
     "<at::native::OpaqueType<2> >(at::TensorIterator&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, "
     "char const*, long)#1}>(...)", "kvarn::store", "kvarn_glue"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(c10::BFloat16)#1}>(...)",
     "kvarn::attention[decode]", "kvarn_glue"),
    ("Memcpy HtoD (Pinned -> Device)", "kvarn::store", "kvarn_glue"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)", None, "other"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
     "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
     "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false, false, true, true, false, false, true, true, "
     "false, false, false>>>>(...)", None, "flash_attention"),
    ("void flash::prepare_varlen_num_blocks_kernel<1, 16, true>(int, int, int, int const*, int const*, int const*, "
     "int const*, int const*, int const*, int, int, int, int, int, cutlass::FastDivmod, cutlass::FastDivmod, int*, "
     "int*, bool)", None, "flash_attention"),
    ("void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t>, 4, 3, true>(flash::Flash_fwd_params)", None, "flash_attention"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", None, "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", None, "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>"
     "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8::Params)", None, "gemm"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false, "
     "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched"
     "<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(...)", None, "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
     "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, "
     "float const*, __nv_bfloat16 const*, float const*, __nv_bfloat16*, void*, long, float*, int*)", None, "gemm"),
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>(c10::BFloat16*, c10::BFloat16 const*, long, long, "
     "c10::BFloat16 const*, float, int, int)", None, "norm_rope_act"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long, c10::BFloat16*, "
     "c10::BFloat16 const*, float, int, int)", None, "norm_rope_act"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*, c10::BFloat16*, "
     "c10::BFloat16 const*, int, long, long, long, int, int, int)", None, "norm_rope_act"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::silu_kernel<c10::BFloat16>(c10::BFloat16 "
     "const&)), true>(c10::BFloat16*, c10::BFloat16 const*, int)", None, "norm_rope_act"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", None, "norm_rope_act"),
    ("triton_poi_fused_mul_silu_slice_1", None, "norm_rope_act"),
    ("_temperature_kernel", None, "sampling"),
    ("_gumbel_sample_kernel", None, "sampling"),
    ("_topk_topp_kernel", None, "sampling"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)", None, "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
     "long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)", None, "sampling"),
    ("_gather_block_tables_kernel", None, "runner"),
    ("_compute_slot_mappings_kernel", None, "runner"),
    ("_prepare_pos_seq_lens_kernel", None, "runner"),
    ("_post_update_kernel", None, "runner"),
    ("Memset (Device)", None, "memcpy"),
    ("Memcpy DtoH (Device -> Pinned)", None, "memcpy"),
]


@pytest.mark.parametrize("name,annotation,cat", KERNELS, ids=[f"{i}-{c}" for i, (_, _, c) in enumerate(KERNELS)])
def test_classify_realistic_kernel_names(name, annotation, cat):
    assert P.classify(name, annotation) == cat
    assert cat in P.LABELS


def test_kv_floor_arithmetic():
    s = resolve_model("qwen3-8b")
    L, H, D = s.num_layers, s.num_kv_heads, s.head_dim
    fmt = get_format("kvarn_k4v2_g128")
    assert fmt.slot_bytes(D) == 108  # README: 108 B per token per head against 512 for FP16
    kv = P.kv_read_bytes("kvarn_k4v2_g128", [4096] * 64, L, H, D)
    assert kv["packed"] == 64 * 4096 * 36 * 8 * 108 and kv["tail"] == 0
    assert kv["fp16_equivalent"] == 64 * 4096 * 36 * 8 * 512
    fp = P.kv_read_bytes("auto", [4096] * 64, L, H, D)
    assert fp["total"] == kv["fp16_equivalent"]
    assert P.floor_ms(fp["total"]) == pytest.approx(1e3 * 38_654_705_664 / 4.1e12)  # 38.7 GB -> 9.43 ms
    assert kv["total"] / fp["total"] == pytest.approx(108 / 512)
    # 4100 tokens: 32 full tiles packed + 4 tokens in the 16-bit tail
    kv2 = P.kv_read_bytes("kvarn_k4v2_g128", [4100], L, H, D)
    assert kv2["packed"] == 4096 * L * H * 108 and kv2["tail"] == 4 * L * H * 4 * D
    st = P.store_bytes("kvarn_k4v2_g128", new_tokens=64, tiles=2, layers=L, kv_heads=H, head_dim=D)
    assert st["flush"] == 2 * L * H * (fmt.record_bytes(D) + 128 * 4 * D)
    assert st["tail"] == 64 * L * H * 8 * D
    assert P.store_bytes("auto", 64, 0, L, H, D)["flush"] == 64 * L * H * 8 * D
    w = P.weight_read_bytes(s, "bfloat16")
    assert w == pytest.approx(s.weight_bytes("bfloat16") - s.vocab_size * s.hidden_size * 2)
    assert 15e9 < w < 17e9


def test_prompt_lengths_stagger_over_one_tile():
    lens = P.prompt_lengths(64, 4096, True)
    assert max(lens) == 4096 and min(lens) == 4096 - 126 and len(set(lens)) == 64
    assert P.prompt_lengths(3, 100, False) == [100, 100, 100]


def _trace():
    X = "X"
    return [
        {"ph": X, "cat": "user_annotation", "name": "kvarn::store", "tid": 7, "ts": 100, "dur": 50},
        {"ph": X, "cat": "user_annotation", "name": "kvarn::attention[decode]", "tid": 7, "ts": 200, "dur": 50},
        {"ph": X, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 7, "ts": 110, "dur": 2,
         "args": {"correlation": 1}},
        {"ph": X, "cat": "cuda_driver", "name": "cuLaunchKernelEx", "tid": 7, "ts": 120, "dur": 2,
         "args": {"correlation": 2}},
        {"ph": X, "cat": "cuda_driver", "name": "cuLaunchKernelEx", "tid": 7, "ts": 210, "dur": 2,
         "args": {"correlation": 3}},
        {"ph": X, "cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": 7, "ts": 300, "dur": 2,
         "args": {"correlation": 4}},
        {"ph": X, "cat": "kernel", "name": "void at::native::index_elementwise_kernel<128, 4>", "ts": 1000,
         "dur": 10, "args": {"correlation": 1}},
        {"ph": X, "cat": "kernel", "name": "_store_tiles_kernel", "ts": 1010, "dur": 30, "args": {"correlation": 2}},
        {"ph": X, "cat": "kernel", "name": "records_kernel", "ts": 1040, "dur": 100,
         "args": {"correlation": 3}},
        {"ph": X, "cat": "kernel", "name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "ts": 1100, "dur": 100,
         "args": {"correlation": 4}},  # overlaps the attention kernel by 40 us (another stream)
        {"ph": X, "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 1300, "dur": 10,
         "args": {"correlation": 99}},
    ]


def test_aggregate_trace_links_kernels_to_plugin_ranges():
    agg = P.aggregate_trace(_trace())
    c = agg["category_us"]
    assert c["kvarn_glue"] == 10 and c["kv_store"] == 30 and c["kvarn_decode"] == 100 and c["gemm"] == 100
    assert c["memcpy"] == 10 and c["other"] == 0
    assert agg["busy_us"] == 10 + 30 + 160 + 10 and agg["span_us"] == 310 and agg["kernels"] == 5


def test_step_rows_put_costs_next_to_floors():
    s = resolve_model("qwen3-8b")
    agg = P.aggregate_trace(_trace())
    r = {"kv_dtype": "kvarn_k4v2_g128", "steps": 2, "batch": 2, "layers": s.num_layers, "kv_heads": 8,
         "head_dim": 128, "ctx": [4096, 4100], "prompt_lens": [4090, 4094], "warmup": 3,
         "weight_read_bytes": P.weight_read_bytes(s, "bfloat16"), "trace": agg, "event_ms_median": 0.2,
         "wall_ms": 0.3, "hook": {"plan_calls": 2, "plan_ms": 1.0, "store_host_ms": 2.0, "attn_host_ms": 3.0,
                                  "tiles": 2, "new_tokens": 4}}
    rows = {x["key"]: x for x in P.step_rows(r)}
    assert rows["kvarn_decode"]["ms"] == pytest.approx(0.05)
    kv = P.kv_read_bytes("kvarn_k4v2_g128", [4096, 4100], s.num_layers, 8, 128)
    assert rows["kvarn_decode"]["floor_ms"] == pytest.approx(P.floor_ms(kv["packed"]))
    assert rows["kvarn_decode"]["x_floor"] == pytest.approx(0.05 / P.floor_ms(kv["packed"]))
    assert rows["gemm"]["floor_ms"] == pytest.approx(P.floor_ms(r["weight_read_bytes"]))
    assert rows["host_plan"]["ms"] == 0.5 and rows["gpu_idle"]["ms"] == pytest.approx((310 - 210) / 2e3)
    assert sum(x["share"] for k, x in rows.items() if k in dict(P.CATEGORIES)) == pytest.approx(
        (10 + 30 + 100 + 100 + 10) / 210)
    assert r["floors"]["tiles_per_step"] == 1


def test_plan_hook_times_without_changing_results(monkeypatch):
    from kvarn.vllm_plugin import ops, step_plan

    monkeypatch.setattr(step_plan, "plan_step", step_plan.plan_step)  # restored after the test
    for name in ("store", "attention"):
        monkeypatch.setattr(ops, name, getattr(ops, name))
    args = (np.array([0, 1, 4]), np.array([128, 131]), 2, np.array([0, 1], dtype=np.int32),
            torch.arange(8, dtype=torch.int32).view(2, 4), 128, "cpu")
    ref = step_plan.plan_step(*args)
    hook = P.PluginHook()
    assert hook.install() and step_plan.plan_step is not ref
    hook.active = True
    plan = step_plan.plan_step(*args)
    assert hook.plan_calls == 1 and hook.plan_s > 0 and hook.tiles == ref.num_tiles == 1 and hook.new_tokens == 4
    assert plan.num_tiles == ref.num_tiles and torch.equal(plan.tile_block_ids, ref.tile_block_ids)
    assert np.array_equal(plan.dec_rows, ref.dec_rows) and np.array_equal(plan.cont_rows, ref.cont_rows)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_cli_says_in_one_line_that_vllm_is_missing():
    p = run_cli("profile", "--steps", "2", timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM" in lines[0] and "GPU" in lines[0], p.stderr
    p = run_cli("profile", "--kv-dtype", "nope", timeout=60)
    assert p.returncode == 2 and "unknown kv dtype" in p.stderr


def test_cli_rejects_a_bad_engine_argument_in_one_line():
    p = run_cli("profile", "-E", "max_num_batched_tokens", timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == ("error: --engine-arg 'max_num_batched_tokens' is not key=value, e.g. --engine-arg "
                                "enforce_eager=true"), p.stderr


def test_engine_arguments_reach_the_workers_spec(monkeypatch, tmp_path):
    """`kvarn profile -E k=v` puts the parsed arguments into each engine process's spec (its LLM(...) keywords)."""
    monkeypatch.setattr(P, "check_environment", lambda: None)

    class NoEngine:
        def run(self, cmd, log, timeout_s, env=None, engine_args=None):
            raise SystemExit(engine_args)

    import kvarn.engines.launch as launch

    monkeypatch.setattr(launch, "Launcher", NoEngine)
    with pytest.raises(SystemExit) as stop:
        P.profile("qwen3-0.6b", ["auto"], 2, 64, 1, workdir=str(tmp_path),
                  engine_args=["max-num-batched-tokens=8192", "enforce_eager=true"])
    want = {"max_num_batched_tokens": 8192, "enforce_eager": True}
    assert stop.value.code == {"gpu_memory_utilization": 0.9, **want}
    assert json.loads((tmp_path / "auto" / "spec.json").read_text())["engine_args"] == want


def test_prefill_floor_arithmetic():
    # 2 prompts of 3 and 4 tokens: 7 tokens, causal pairs 3*4/2 + 4*5/2 = 16
    fl = P.prefill_flops([3, 4], layers=2, q_heads=4, head_dim=8, params=1000)
    assert fl == {"gemm": 2.0 * 1000 * 7, "attention": 4.0 * 4 * 8 * 16 * 2, "tokens": 7}
    L, H, D = 36, 8, 128
    fmt = get_format("kvarn_k4v2_g128")
    # 300 tokens: 2 full tiles flushed (each reads 128 16-bit tokens, writes a record), 44 to the 16-bit tail
    got = P.prefill_store_bytes("kvarn_k4v2_g128", [300], L, H, D)
    assert got == {"flush": 2 * L * H * (fmt.record_bytes(D) + 128 * 4 * D), "tail": 44 * L * H * 8 * D}
    assert P.prefill_store_bytes("auto", [300], L, H, D) == {"flush": 300 * L * H * 8 * D, "tail": 0.0}


def test_step_rows_of_a_prefill_use_flop_floors():
    """Qwen3-8B, 4 prompts of 1,024 tokens over 2 steps, by hand: body parameters 36 x (2 x 4096^2 + 2 x 4096 x
    1024 + 3 x 4096 x 12288 + 2 x 4096 + 2 x 128) + 4096 = 6,946,075,648, LM head 151,936 x 4096; at 989 TFLOP/s."""
    s = resolve_model("qwen3-8b")
    agg = P.aggregate_trace(_trace())
    lens = [1024] * 4
    r = {"kv_dtype": "kvarn_k4v2_g128", "phase": "prefill", "steps": 2, "batch": 4, "layers": s.num_layers,
         "q_heads": s.num_q_heads, "kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "ctx": lens,
         "prompt_lens": lens, "weight_read_bytes": P.weight_read_bytes(s, "bfloat16"), "weight_bytes_per_param": 2,
         "lm_head_params": float(s.vocab_size * s.hidden_size), "trace": agg, "event_ms_median": 40.0,
         "wall_ms": 41.0, "hook": {}}
    assert r["weight_read_bytes"] / 2 - r["lm_head_params"] == 6_946_075_648
    rows = {x["key"]: x for x in P.step_rows(r)}
    # (2 x 6,946,075,648 x 4,096 + 2 x 622,329,856 x 4) / 989e12 / 2 steps
    assert rows["gemm"]["floor_ms"] == pytest.approx(28.770, abs=1e-3)
    # 4 x 32 heads x 128 x (4 x 1024 x 1025 / 2 pairs) x 36 layers / 989e12 / 2
    assert rows["flash_attention"]["floor_ms"] == pytest.approx(0.6260, abs=1e-4)
    # 32 tiles x 36 layers x 8 heads x (13,824 B record + 128 x 512 B read) / 4.1 TB/s / 2; no tail: 1024 = 8 tiles
    assert rows["kv_store"]["floor_ms"] == pytest.approx(0.08919, abs=1e-5)
    assert "kvarn_glue" not in rows or rows["kvarn_glue"]["floor_ms"] is None
    assert rows["step"]["floor_ms"] == pytest.approx(28.770 + 0.6260 + 0.08919, abs=2e-3)
    assert rows["step"]["category"].startswith("prefill step") and r["floors"]["tiles_per_step"] == 16
    # a prompt that leaves 44 tokens in the 16-bit tail: their writes are floored on the glue row (torch indexing)
    r2 = {**r, "prompt_lens": [300], "ctx": [300], "batch": 1, "steps": 1}
    glue = {x["key"]: x for x in P.step_rows(r2)}["kvarn_glue"]
    assert glue["floor_ms"] == pytest.approx(P.floor_ms(44 * s.num_layers * 8 * 8 * 128))


def test_cli_rejects_an_unknown_phase_in_one_line():
    p = run_cli("profile", "--phase", "warmup", timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == "error: --phase 'warmup' is not a phase; accepted: decode, prefill", p.stderr


def test_tables_render_a_prefill_next_to_its_fp16():
    from kvarn_cli.commands import profile as C

    s = resolve_model("qwen3-8b")
    results = []
    for d in ("auto", "kvarn_k4v2_g128"):
        r = {"status": "ok", "kv_dtype": d, "model": s.name, "phase": "prefill", "steps": 2, "batch": 4,
             "context": 1024, "mean_ctx": 1024.0, "layers": s.num_layers, "q_heads": s.num_q_heads,
             "kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "ctx": [1024] * 4, "prompt_lens": [1024] * 4,
             "weight_read_bytes": P.weight_read_bytes(s, "bfloat16"), "weight_bytes_per_param": 2,
             "lm_head_params": float(s.vocab_size * s.hidden_size), "trace": P.aggregate_trace(_trace()),
             "event_ms_median": 20.0 if d == "auto" else 40.0, "wall_ms": 41.0, "hook": {}, "engine_start_s": 90.0,
             "fill_s": 0.125, "warm_fill_s": 0.5}
        r["rows"] = P.step_rows(r)
        results.append(r)
    width, C.out.width = C.out.width, 250  # one line per row
    try:
        with C.out.capture() as cap:
            C._print_one(results[1])
            C._print_compare(results)
    finally:
        C.out.width = width
    text = cap.get()
    assert "the prefill, 2 steps" in text and "TFLOP/s" in text
    assert "4,096 prompt tokens in 2 steps: every request's first token after 0.125 s" in text
    assert "prefill step by category" in text
    step = next(ln for ln in text.splitlines() if "prefill step (CUDA events" in ln and "x)" in ln)
    assert "20.000" in step and "40.000 (2.00x)" in step  # the candidate's step against FP16's
