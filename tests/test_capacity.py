import json

import pytest

from kvarn.capacity import H200_GIB, capacity
from kvarn.errors import KvarnError
from kvarn.formats import get_format
from kvarn.shapes import resolve_model
from tests.helpers import run_cli

# KV-cache tokens vLLM 0.26.0 reports on one H200 for the Qwen3-8B shape at gpu_memory_utilization 0.9
VLLM_FP16_TOKENS = 791_792
VLLM_TQ_K3V4_TOKENS = 2_505_920
# the same machine and model, kvarn_k4v2_g128 at max_num_seqs 256: vLLM's num_gpu_blocks x 128
VLLM_KVARN_TOKENS = 27_346 * 128


def test_matches_vllm_report_qwen3_8b():
    s = resolve_model("qwen3-8b")
    fp16 = capacity(s, get_format("auto"))
    tq = capacity(s, get_format("turboquant_k3v4_nc"))
    assert fp16.kv_tokens == pytest.approx(VLLM_FP16_TOKENS, rel=0.01)
    assert tq.kv_tokens == pytest.approx(VLLM_TQ_K3V4_TOKENS, rel=0.01)
    assert tq.ratio_vs_fp16 == pytest.approx(VLLM_TQ_K3V4_TOKENS / VLLM_FP16_TOKENS, rel=0.01)
    assert fp16.bytes_per_token == 36 * 8 * 512
    assert tq.bytes_per_token == 32 * 8 * 118 + 4 * 8 * 512
    assert tq.block_size == 32


def test_kvarn_reserves_tail_and_stays_above_target():
    s = resolve_model("qwen3-8b")
    kv = capacity(s, get_format("kvarn_k4v2_g128"), context=16384)
    assert kv.bytes_per_token == 36 * 8 * 108
    # the unfinished tile + the 16-token sink + the window's two halves of 32
    assert kv.fixed_bytes_per_request == (128 + 16 + 2 * 32) * 8 * 512 * 36
    assert kv.reserved_requests == 256
    assert kv.kv_tokens % 128 == 0
    assert 4.4 <= kv.ratio_vs_fp16 < 4.74
    assert kv.kv_tokens == pytest.approx(VLLM_KVARN_TOKENS, rel=0.002)  # the pool vLLM sized after the reservation
    more = capacity(s, get_format("kvarn_k4v2_g128"), max_num_seqs=1024)
    assert more.kv_tokens < kv.kv_tokens  # a larger tail reservation costs pool tokens
    assert kv.max_concurrency <= 256


def test_tp_splits_heads_and_weights():
    s = resolve_model("qwen3-32b")
    one = capacity(s, get_format("auto"), tp=2)
    assert one.bytes_per_token == 64 * 4 * 512
    with pytest.raises(KvarnError, match="--tp 3 does not divide the 64 attention heads"):
        capacity(s, get_format("auto"), tp=3)
    with pytest.raises(KvarnError, match="does not fit"):
        capacity(s, get_format("auto"), tp=1, gpu_mem_gib=24)


def test_bad_memory_values():
    s = resolve_model("qwen3-8b")
    with pytest.raises(KvarnError, match="gpu-memory-utilization"):
        capacity(s, get_format("auto"), utilization=1.5)
    with pytest.raises(KvarnError, match="gpu-mem-gib"):
        capacity(s, get_format("auto"), gpu_mem_gib=-1)


def test_cli_capacity_json():
    r = run_cli("capacity", "--model", "qwen3-8b", "--kv-dtype", "auto,turboquant_k3v4_nc", "--json",
                "--gpu-mem-gib", str(H200_GIB))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["kv_dtype"] for x in rows] == ["auto", "turboquant_k3v4_nc"]
    assert rows[1]["ratio_vs_fp16"] == pytest.approx(3.165, abs=0.01)


def test_cli_capacity_table():
    r = run_cli("capacity", "--model", "qwen3-32b", "--tp", "2")
    assert r.returncode == 0, r.stderr
    for name in ("auto", "fp8", "kvarn_k4v2_g128", "turboquant_k3v4_nc"):
        assert name in r.stdout


@pytest.mark.parametrize("args,msg", [
    (("capacity", "--model", "nope"), "unknown model 'nope'"),
    (("capacity", "--kv-dtype", "fp9"), "unknown kv dtype 'fp9'"),
    (("capacity", "--model", "qwen3-32b", "--tp", "3"), "--tp 3 does not divide"),
    (("capacity", "--gpu-memory-utilization", "2"), "--gpu-memory-utilization must be in (0, 1]"),
    (("capacity", "--gpu-mem-gib", "0"), "--gpu-mem-gib must be a positive"),
    (("capacity", "--model", "nobody/NoSuchModel-7B"), "not in the local Hugging Face cache"),
])
def test_cli_bad_input_one_line_exit_2(args, msg):
    r = run_cli(*args)
    assert r.returncode == 2
    assert msg in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
