"""Edge cases of the kernels against the PyTorch reference (interpreter on a CPU): garbage left in the 16-bit tail
past each row's length (NaN / Inf from an earlier request), a NaN query row that must not leak into other rows,
zero-length query rows in a batch of continuation chunks (the dense prefill path), the 2-bit-key preset at D=128 in
bf16, more splits than blocks, and the per-step store for other presets / head dims than test_kernels.py uses."""
import math

import numpy as np
import pytest
import torch

from kvarn.formats import get_format
from kvarn.kernels import decode_attention, store_decode
from kvarn.method.reference import dequantize_tiles, quantize_tiles, reference_attention
from kvarn.vllm_plugin.dense_prefill import dense_prefill
from kvarn.vllm_plugin.step_plan import continuation_plan
from tests.kernels.helpers import decode_reference, paged_setup, rel_err, request_kv


def _decode(name, D, Hq, Hk, dtype, lens, splits=2, poison=None):
    fmt = get_format(name)
    st = paged_setup(fmt, D, Hk, lens, dtype)
    q = (torch.randn(len(lens), Hq, D) * 2).to(dtype)
    ref = decode_reference(q, st, fmt, D, 1 / math.sqrt(D))
    if poison is not None:  # stale data past each row's valid tail tokens (a finished request's leftovers)
        for b, s in enumerate(lens):
            sl, nt = int(st["tail_slots"][b]), s % fmt.group
            st["tail_k"][sl, :, nt:] = poison
            st["tail_v"][sl, :, nt:] = poison
    out = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                           st["tail_slots"], fmt, 1 / math.sqrt(D), num_splits=splits,
                           out=torch.empty(q.shape, dtype=torch.float32))
    return out, ref


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_decode_ignores_garbage_past_the_tail(poison):
    out, ref = _decode("kvarn_k4v2_g64", 64, 4, 2, torch.float16, [150, 64, 5], poison=poison)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3


def test_decode_k2v2_bf16_d128_and_more_splits_than_blocks():
    out, ref = _decode("kvarn_k2v2_g128", 128, 4, 2, torch.bfloat16, [300, 128])
    assert rel_err(out, ref) < 1e-3
    out, ref = _decode("kvarn_k4v2_g64", 64, 4, 2, torch.float16, [70, 3], splits=16)
    assert rel_err(out, ref) < 1e-3


def test_decode_nan_query_row_stays_in_its_row():
    fmt = get_format("kvarn_k4v2_g64")
    st = paged_setup(fmt, 64, 2, [150, 70], torch.float16)
    q = torch.randn(2, 4, 64).half()
    q[0, 0, 3] = float("nan")
    out = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                           st["tail_slots"], fmt, 0.125, num_splits=2)
    assert torch.isfinite(out[1]).all()


def _prefill(fmt, D, Hq, Hk, dtype, lens, qlens, poison=None):
    """Continuation chunks (each row's last qlens[b] positions) through the dense prefill path with the record
    decoder kernel, against the fp32 oracle over the same stored state."""
    st = paged_setup(fmt, D, Hk, lens, dtype)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    q = (torch.randn(int(qsl[-1]), Hq, D) * 2).to(dtype)
    scale = 1 / math.sqrt(D)
    ref = []
    for b, s in enumerate(lens):
        a, e = int(qsl[b]), int(qsl[b + 1])
        if e > a:
            k, v = request_kv(st, fmt, D, b)
            ref.append(reference_attention(q[a:e].float().transpose(0, 1), k, v, scale,
                                           causal_offset=s - (e - a)).transpose(0, 1))
    if poison is not None:
        for b, s in enumerate(lens):
            sl = int(st["tail_slots"][b])
            st["tail_k"][sl, :, s % fmt.group:] = poison
            st["tail_v"][sl, :, s % fmt.group:] = poison
    plan = continuation_plan(qsl.numpy().astype(np.int64), lens, st["tail_slots"].numpy(), st["block_table"],
                             fmt.group)
    out = dense_prefill(plan, q.float(), st["cache"], st["block_table"], st["tail_k"], st["tail_v"], fmt, scale,
                        use_kernels=True)
    return out, torch.cat(ref)


def test_prefill_zero_length_query_row_k2v2():
    # a row with no query tokens this step, and the 2-bit-key preset through the dense prefill path
    out, ref = _prefill(get_format("kvarn_k2v2_g128"), 64, 2, 1, torch.float16, [140, 50, 130], [10, 0, 2])
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3


def test_prefill_ignores_garbage_past_the_tail():
    out, ref = _prefill(get_format("kvarn_k4v2_g64"), 64, 4, 2, torch.bfloat16, [150, 40], [20, 40],
                        poison=float("nan"))
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("name,D,dtype", [("kvarn_k4v2_g128", 128, torch.bfloat16),
                                          ("kvarn_k4v4_g128", 64, torch.bfloat16)])
def test_store_decode_flushes_completed_tiles(name, D, dtype):
    fmt = get_format(name)
    g, H = fmt.group, 2
    seq = [g, 5, 0, 2 * g]  # completes its 1st tile, mid-tile, padded row, completes its 2nd
    B, S = len(seq), len(seq) + 1
    tk, tv = torch.randn(S, H, g, D).to(dtype), torch.randn(S, H, g, D).to(dtype)
    k, v = torch.randn(B, H, D).to(dtype), torch.randn(B, H, D).to(dtype)
    slots = torch.randperm(S)[:B].to(torch.int32)
    bt = torch.randperm(3 * B).to(torch.int32).reshape(B, 3)
    cache = torch.full((3 * B, H, fmt.record_bytes(D)), 0xAB, dtype=torch.uint8)
    store_decode(k, v, cache, bt, torch.tensor(seq, dtype=torch.int32), tk, tv, slots, fmt)
    for b, s in enumerate(seq):
        if s > 0 and s % g == 0:
            kk, vv = tk[slots[b].long()][None], tv[slots[b].long()][None]
            got = dequantize_tiles(cache[int(bt[b, s // g - 1])][None], fmt, D)
            ref = dequantize_tiles(quantize_tiles(kk, vv, fmt), fmt, D)
            assert rel_err(got[0], ref[0]) < 0.06 and rel_err(got[1], ref[1]) < 0.06
