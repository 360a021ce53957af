"""Decode attention with token-row tiles (DecodeConfig(layout=1): kvarn_attention_tok_kernel) against the fp32
reference and against the default layout-0 kernel on the same inputs (CPU: through TRITON_INTERPRET=1)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvarn.formats import get_format
from kvarn.kernels import decode_attention
from kvarn.kernels.decode import (DEFAULT_CONFIG, SWEEP_CONFIGS, DecodeConfig, effective_config, tok_warps)
from kvarn.kernels.common import layout
from tests.test_kernels import decode_reference, paged_setup, rel_err

LENS = [0, 130, 300]  # a padded (empty) row, tile + tail, several tiles + tail (g=128: 1 and 2 full tiles)

TOK_CASES = [
    # name, D, Hq, Hk, dtype, seq_lens
    ("kvarn_k4v2_g128", 128, 8, 2, torch.float16, LENS),  # GQA 4:1 (the microbench group), D=128
    ("kvarn_k4v2_g128", 64, 2, 2, torch.bfloat16, LENS),  # MHA 1:1, D=64
    ("kvarn_k4v4_g128", 64, 4, 1, torch.bfloat16, LENS),  # 4-bit values: BT = 64 token planes
    ("kvarn_k4v2_g64", 64, 4, 4, torch.float16, [0, 130, 300]),  # g=64: 2 and 4 full tiles, value planes of 16
]


def _args(name, D, Hq, Hk, dtype, seq_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    fmt = get_format(name)
    st = paged_setup(fmt, D, Hk, seq_lens, dtype, gen=gen)
    q = (torch.randn(len(seq_lens), Hq, D, generator=gen) * 2).to(dtype)
    scale = 1 / math.sqrt(D)
    args = (q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"], st["tail_slots"], fmt,
            scale)
    return fmt, st, q, scale, args


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name,D,Hq,Hk,dtype,seq_lens", TOK_CASES)
def test_decode_tokrows_matches_reference_and_layout0(name, D, Hq, Hk, dtype, seq_lens, splits):
    fmt, st, q, scale, args = _args(name, D, Hq, Hk, dtype, seq_lens, seed=D + 10 * Hq + 1000 * splits + len(name))
    ref = decode_reference(q, st, fmt, D, scale)
    tok = DecodeConfig(layout=1)
    out_tok = decode_attention(*args, num_splits=splits, out=torch.empty(q.shape, dtype=torch.float32), config=tok)
    out_row = decode_attention(*args, num_splits=splits, out=torch.empty(q.shape, dtype=torch.float32),
                               config=DecodeConfig())
    assert torch.isfinite(out_tok).all()
    e_tok, e_row = rel_err(out_tok, ref), rel_err(out_row, ref)
    assert e_tok < 1e-3, (e_tok, e_row)
    # the two layouts fold the same scales in the same fp16 hi/lo operands: they agree far below the 1e-3 bar
    assert rel_err(out_tok, out_row) < 2e-5, (rel_err(out_tok, out_row), e_tok, e_row)
    for b, s in enumerate(seq_lens):
        if s == 0:
            assert torch.equal(out_tok[b], torch.zeros_like(out_tok[b]))
    out = decode_attention(*args, num_splits=splits, config=tok)  # q's dtype
    assert out.dtype == dtype and rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 8e-3)


# sweep candidates beside the default token-row kernel: N = 8 (mma.sync tiles), int16-pair tiles (layout 2), both
VARIANTS = [DecodeConfig(layout=1, bn=8), DecodeConfig(layout=2), DecodeConfig(layout=2, bn=8),
            # pair kernel with every tile load pipelineable (int32 scale pairs, per-row softmax denominator)
            DecodeConfig(layout=2, bn=8, pipe=1), DecodeConfig(layout=2, pipe=1),
            # the same with the key scales / zero points in one load (an async copy on 2 warps too); and with the
            # 16-bit tail's programs in the same launch
            DecodeConfig(num_warps=2, num_stages=5, layout=2, bn=8, pipe=2),
            DecodeConfig(num_warps=2, num_stages=5, layout=2, bn=8, pipe=2, tail=1),
            # programmatic dependent launches (GPU only: the interpreter runs it as pdl = 0; its name round-trips)
            DecodeConfig(num_warps=2, num_stages=5, layout=2, bn=8, pipe=2, tail=1, pdl=1),
            # value codes into the dots as E + code, E * sum(p * sV) out with the zero-point term
            DecodeConfig(num_warps=2, num_stages=5, layout=2, bn=8, pipe=2, tail=1, pdl=1, voff=1),
            # q x sK's hi and lo in the two column halves of one N = 8 key operand (one key MMA per plane)
            DecodeConfig(ksplit=3, num_warps=2, num_stages=5, layout=2, bn=8, pipe=2, tail=1, pdl=1)]


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: c.name)
@pytest.mark.parametrize("name,D,Hq,Hk,dtype,seq_lens", TOK_CASES)
def test_decode_tok_variants_match_reference(name, D, Hq, Hk, dtype, seq_lens, cfg):
    fmt, st, q, scale, args = _args(name, D, Hq, Hk, dtype, seq_lens, seed=D + 10 * Hq + 5)
    ref = decode_reference(q, st, fmt, D, scale)
    out, out_tok = (decode_attention(*args, config=c, num_splits=3, out=torch.empty(q.shape, dtype=torch.float32))
                    for c in (cfg, DecodeConfig(layout=1)))  # two out buffers: the check compares two kernels
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-3, (rel_err(out, ref), rel_err(out_tok, ref))
    assert rel_err(out, out_tok) < 2e-5  # same fp16 operands and fp32 accumulation, other MMA shapes / order
    for b, s in enumerate(seq_lens):
        if s == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
    assert DecodeConfig.from_name(cfg.name) == cfg


@pytest.mark.parametrize("name,D", [("kvarn_k2v2_g128", 128), ("kvarn_k4v2_g128", 64)])
def test_pipe2_scale_load_gives_pipe1_output(name, D):
    """pipe = 2 changes how the key scales / zero points are loaded (2-bit keys: 4 planes split out of one load) and
    sums q . zK of all planes in one reduction: the same operands, the same output up to fp32 summation order, and
    within the bar against the reference."""
    fmt, st, q, scale, args = _args(name, D, 8, 2, torch.float16, [0, 257, 140], seed=D + 3)
    p1, p2, p2t = (decode_attention(*args, num_splits=2, out=torch.empty(q.shape, dtype=torch.float32),
                                    config=DecodeConfig(2, 2, 1, 2, 5, layout=2, bn=8, pipe=pipe, tail=tail))
                   for pipe, tail in ((1, 0), (2, 0), (2, 1)))
    assert rel_err(p2, p1) < 1e-5  # fp32 summation order only
    assert rel_err(p2, decode_reference(q, st, fmt, D, scale)) < 1e-3
    assert torch.equal(p2t, p2)  # the tail's programs in the records launch: the same partials, bit for bit


def test_folded_ksplit_where_the_group_fits_half_of_n():
    """ksplit = 3 runs as the two-MMA split wherever the group does not fit in half of N = 8 columns (group > 4,
    N = 16, other kernels); there it gives the ksplit = 2 output bit for bit."""
    from kvarn.kernels.decode import folded_ksplit

    k3 = DecodeConfig(ksplit=3, num_warps=2, num_stages=5, layout=2, bn=8, pipe=2)
    assert [folded_ksplit(k3, 8, g) for g in (1, 3, 4, 5, 8)] == [3, 3, 3, 2, 2]
    assert folded_ksplit(k3, 16, 4) == 2 and folded_ksplit(replace(k3, ksplit=2), 8, 4) == 2
    assert DecodeConfig.from_name(k3.name) == k3 and k3.name.startswith("u2k3")
    name, D = "kvarn_k4v2_g128", 64
    fmt, st, q, scale, args = _args(name, D, 16, 2, torch.float16, [0, 257, 140], seed=11)  # group 8
    kw = dict(num_splits=2, out=torch.empty(q.shape, dtype=torch.float32))
    out3 = decode_attention(*args, config=k3, **kw).clone()
    out2 = decode_attention(*args, config=replace(k3, ksplit=2), **kw)
    assert torch.equal(out3, out2)


@pytest.mark.parametrize("unpack", [0, 1])
def test_decode_tokrows_unpack_variants(unpack):
    # UNPACK 2 (inline PTX) maps to 1 under the interpreter; 0 (Triton casts) is its own code path
    name, D, Hq, Hk, dtype = "kvarn_k4v2_g128", 128, 4, 1, torch.float16
    fmt, st, q, scale, args = _args(name, D, Hq, Hk, dtype, [300, 0, 129], seed=7 + unpack)
    ref = decode_reference(q, st, fmt, D, scale)
    out = decode_attention(*args, num_splits=2, out=torch.empty(q.shape, dtype=torch.float32),
                           config=DecodeConfig(unpack=unpack, layout=1))
    assert rel_err(out, ref) < 1e-3


def test_tokrows_config_plumbing():
    assert DEFAULT_CONFIG.name == "u2k3v1w2s5x1n8L2p2t1g1"  # the H200 sweep's best (session 18)
    tok = DecodeConfig(2, 2, 1, 4, 1, maxnreg=128, layout=1)
    assert tok.name != DecodeConfig(2, 2, 1, 4, 1, maxnreg=128).name and tok.name.endswith("L1")
    assert DecodeConfig().name == "u2k2v1w4s1x1"  # names of layout-0 entries are unchanged (sweep history)
    assert {c.num_warps for c in SWEEP_CONFIGS if c.layout == 1} >= {4, 8}
    assert len({c.name for c in SWEEP_CONFIGS}) == len(SWEEP_CONFIGS)
    eff = effective_config(tok, torch.device("cpu"))  # interpreter / CPU: inline PTX -> Triton unpack only
    assert eff.unpack == 1 and eff.layout == 1 and eff.maxnreg == 128
    # every warp owns >= 16 distinct M rows (M = g tokens for keys, D channels for values)
    assert tok_warps(layout(get_format("kvarn_k4v2_g128"), 128), 8) == 8
    assert tok_warps(layout(get_format("kvarn_k4v2_g128"), 64), 8) == 4
    assert tok_warps(layout(get_format("kvarn_k4v2_g64"), 128), 8) == 4
    assert tok_warps(layout(get_format("kvarn_k4v2_g128"), 128), 4) == 4


def test_prefill_ignores_tokrows_layout():
    """layout 1 is decode-only: run_attention with prefill=True launches the query-row kernel whatever the layout."""
    from kvarn.kernels.prefill import _launch_prefill

    name, D, Hq, Hk, dtype = "kvarn_k4v2_g64", 64, 2, 1, torch.float16
    fmt, st, _, scale, _ = _args(name, D, Hq, Hk, dtype, [100], seed=3)
    q = (torch.randn(5, Hq, D) * 2).to(dtype)
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    lay = layout(fmt, D)
    outs = []
    for lay_id in (0, 1):
        outs.append(_launch_prefill(q, st["cache"], st["block_table"], qsl, st["seq_lens"], st["tail_k"],
                                    st["tail_v"], st["tail_slots"], torch.empty(q.shape, dtype=torch.float32), lay,
                                    Hq // Hk, Hq // Hk, scale, 5, DecodeConfig(unpack=1, layout=lay_id), 64))
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
