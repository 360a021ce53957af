"""Fused paged decode attention over a KVarN cache + 16-bit tail (split-K flash-decoding, GQA-shared tiles).

Public API (stable; the vLLM backend calls exactly this):

    decode_attention(q, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, fmt, scale,
                     num_splits=None, out=None, *, config=None) -> out
        q           [B, Hq, D] fp16/bf16, NOT rotated (the kernel rotates it in its prologue)
        cache       uint8 [num_blocks, Hk, record_bytes(D)]
        block_table int32 [B, max_blocks]: record row of each full tile of request b
        seq_lens    int32 [B]: tokens visible to the query; seq_len // g full tiles come from records, the last
                    seq_len % g tokens from tail_k / tail_v [S, Hk, g + sink, D] at row tail_slots[b] (int32 [B]),
                    position pos % g; positions below sink (0 <= sink < g) from rows g + pos instead (the
                    attention sink, 16-bit for good). seq_len 0 rows (CUDA-graph padding) produce zeros.
        scale       softmax scale (python float)
        num_splits  context splits per (request, KV head), merged with log-sum-exp; None: tuned / heuristic from
                    B, Hk, block_table.shape[1] and the SM count (host values only, never device data)
        out         optional [B, Hq, D] output (q's dtype, or fp32 for tests); allocated when None
        config      optional DecodeConfig (kernel variant, warps, pipeline depth); None: the tuned / default one
        sink_lens   optional int32 [B]: sink rows row b may read (<= sink, larger values read as sink; 0 where
                    they hold another request's tokens); None: all of them, from a tensor made per call (a CUDA
                    graph captured that way keeps "all": pass a persistent buffer, as the backend does)
        launches    profiling only: a subset of LAUNCHES to run (the output is then not the attention)
        defer       True: a tile that fills at this step (seq_len % g == 0) is still in the tail (its record is
                    written later, by store.flush_layers): (seq_len - 1) // g tiles from records, the rest (up to g
                    rows) from the tail. False (default): seq_len // g from records. An int32 [1] tensor: the same,
                    decided by its value on the device at run time (what a captured decode graph needs).

Launches (fixed from shapes, no host sync -> CUDA-graph capturable): query rotation (B*Hq/16 programs), attention
over the records (B, 1, Hk * num_splits), over the 16-bit tail (B, 1, Hk), merge + rotation back (B*Hq/16).

Self-tuning (CUDA only): the first *eager* call for a key (D, g, kb, vb, group, dtype, context bucket =
block_table.shape[1] rounded up to a power of two, B*Hk bucket) times a few candidate (config, num_splits) pairs
with CUDA events on the caller's real inputs and keeps the fastest for that key. vLLM makes these eager calls
during its warm-up / profile runs, before graph capture; a call made while a stream is capturing never tunes (it
uses the tuned entry if present, else the default), so capture never sees a sync. KVARN_AUTOTUNE=0 turns tuning
off (default config + heuristic splits). kvarn.kernels.prepare(D, device) also checks the inline-PTX code
unpacker once on the device (falls back to the pure-Triton one if it disagrees) before capture.
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, replace

import torch
import triton

from ..errors import KvarnError
from ..formats import KVFormat
from .attention import LOG2E, finish_kernel, kvarn_attention_kernel, mma_bf16, rotate_rows_kernel, tail_attention_kernel
from .attention_tokrows import (kvarn_attention_pair_kernel, kvarn_attention_pair_pipe_kernel,
                                kvarn_attention_tok_kernel)
from .common import as_format, check_cache, check_tail, defer_flag, f16_view, layout


_NAME = re.compile(r"u([012])k([123])v([12])w(\d+)s(\d+)x([0-9.]+)(?:r(\d+))?(?:n(\d+))?(?:L([012]))?(?:p([0-2]))?"
                   r"(?:t(1))?(?:g(1))?(?:o(1))?")


@dataclass(frozen=True)
class DecodeConfig:
    """One compiled variant of the attention kernel (see kvarn.kernels.attention for the knobs)."""

    unpack: int = 2  # codes -> fp16: 0 Triton casts, 1 exponent trick in Triton, 2 inline PTX (prmt/lop3/f16x2)
    ksplit: int = 2  # 2: fp16 hi + lo of q*sK (two key MMAs, ~22-bit operand; rel. err ~1e-4);
    #                  1: fp16 only (~1.3e-3 rel. err in the interpreter: over the 1e-3 bar, timing reference only);
    #                  3: pipe kernel, N = 8, group <= 4: hi and lo in the two column halves of one key operand (one
    #                  key MMA, halves added by a lane shuffle); elsewhere it runs as 2
    vsplit: int = 1  # same for p*sV
    num_warps: int = 4
    num_stages: int = 1  # software pipelining depth of the tile loop (1: none; latency hidden by resident programs)
    split_mult: float = 1.0  # multiplier on the heuristic split count (tuning candidates)
    maxnreg: int | None = None  # register cap per thread (more resident programs per SM, maybe spills)
    layout: int = 0  # decode tiles: 0 query rows as the MMA M dim (kvarn_attention_kernel, GQA group padded to 16);
    #                  1 tokens / channels as M, codes as the A operand (kvarn_attention_tok_kernel; decode only,
    #                  prefill always uses 0); 2 the same with the code bytes read as int16 pairs
    #                  (kvarn_attention_pair_kernel: 16-bit tile conversion instead of byte-wise, two M/2 dots)
    bn: int = 0  # layouts 1/2: MMA N (query heads, padded); 0: max(16, group). 8 gives mma.sync (n8) tiles
    pipe: int = 0  # layout 2: 1 = kvarn_attention_pair_pipe_kernel (all tile loads pipelineable: scale runs as
    #                int32 pairs, cp.async with num_stages >= 2; softmax denominator per row); 2 = the same with
    #                the key scales and zero points in one 2D-half load (an async copy on 2 warps too, where the
    #                DP-wide loads of 1 stay synchronous inside the loop) and q . zK of all planes in one reduction
    tail: int = 0  # pipe >= 1: 1 = the 16-bit tail's attention in Hk extra programs of the records kernel's grid
    #                (after the record programs, so they fill the last wave's free slots) instead of its own launch
    pdl: int = 0  # 1: rotation, records (pipe kernel) and merge launched as programmatic dependent launches (sm_90+):
    #               each kernel's programs start while the previous one finishes, building the Hadamard meanwhile
    voff: int = 0  # pipe kernel, vsplit 1: 1 = value codes into the dots as E + code (E 16 or 4; a shift and a lop3
    #                per 2 codes, no sub.f16x2), E * sum(p * sV) taken out with the zero-point term

    @property
    def name(self) -> str:
        return (f"u{self.unpack}k{self.ksplit}v{self.vsplit}w{self.num_warps}s{self.num_stages}"
                f"x{self.split_mult:g}" + (f"r{self.maxnreg}" if self.maxnreg else "")
                + (f"n{self.bn}" if self.bn else "") + (f"L{self.layout}" if self.layout else "")
                + (f"p{self.pipe}" if self.pipe else "") + (f"t{self.tail}" if self.tail else "")
                + (f"g{self.pdl}" if self.pdl else "") + (f"o{self.voff}" if self.voff else ""))

    @classmethod
    def from_name(cls, name: str) -> "DecodeConfig":
        """Inverse of `name` (e.g. 'u2k2v1w4s2x1L1', as the sweep table prints it)."""
        m = _NAME.fullmatch(name.strip())
        if not m:
            raise KvarnError(f"decode config {name!r} is not a name like 'u2k2v1w4s1x1r128' or 'u2k2v1w4s2x1L1' "
                             "(unpack, ksplit, vsplit, warps, stages, split multiplier, [register cap], [N], [layout], "
                             "[pipe], [tail], [pdl], [value offsets])")
        u, k, v, w, st, x, r, bn, lay, pipe, tail, pdl, voff = m.groups()
        return cls(int(u), int(k), int(v), int(w), int(st), float(x), int(r) if r else None, int(lay) if lay else 0,
                   int(bn) if bn else 0, int(pipe) if pipe else 0, int(tail) if tail else 0, int(pdl) if pdl else 0,
                   int(voff) if voff else 0)


# H200 sweeps (B=64, ctx 16384, 32/8 heads, D=128, k4v2_g128; BENCHMARKS.md). Session 5: query-row kernel (layout 0)
# w4 s1 2.14 ms, + register cap 128 1.52 ms, s3 1.48 ms, w8 2.9-4.0 ms; token-row kernel (layout 1) w4 s1 1.40 ms, + cap
# 128 1.11 ms. Session 6 (one run): r128L1 1.00 ms, r128n8L1 0.99, r128L2 1.03, r128n8L2 0.85, n8L2 (no cap) 0.73,
# pipe kernel s2 r128n8L2p1 0.571, s3 0.562 ms (the best; splits 1/4/8 instead of auto: 0.64-0.70 ms); a second
# call, vLLM's FlashAttention as the baseline: that default (4 warps, 3 stages, r128) 0.604 ms vs FA 1.046 ms (0.58x).
# Session 14 (CUDA graphs, each config timed in turn with it): the pipe kernel on 2 warps at 5 stages (a real double
# buffer, see below) 0.843x at B=64 x 16K (0.3735 ms vs FA3 0.969: 0.385x), 0.840x at B=96, 0.882x at the Qwen3-32B
# step (128 x 4K, 64/8 heads), 0.681x at D=64; 1.026x at B=8 x 16K (few programs: more splits win there).
# Session 15: pipe = 2 (no synchronous load left in the tile loop) 0.903x that at B=64 x 16K, 0.906x B=96, 0.903x the
# 32B step, 0.904x B=8, 0.958x D=64; against FA3 in turn 0.362-0.370x (three runs); 7 stages no faster, caps slower
# Session 16: tail = 1 (the 16-bit tail's programs in the records launch) and pdl = 1 (programmatic dependent launches
# of rotation, records and merge), each timed in turn with pipe = 2 alone: 0.992-0.994x at B=64 x 16K, 0.994x B=96,
# 0.915-0.919x the 32B step, 0.950x B=8, 0.933x D=64 (tail alone: 0.995 / 0.998 / 0.936 / 0.961 / 0.940)
# Session 18: ksplit = 3 (one key MMA per plane carrying hi and lo, group <= 4), x that in turn 0.941-0.952 at B=64 x
# 16K, 0.948 B=96, 0.958 B=8, 0.993 D=64, 0.999 the 32B step (group 8: runs as ksplit 2); against FA3 0.342x in turn
DEFAULT_CONFIG = DecodeConfig(2, 3, 1, 2, 5, layout=2, bn=8, pipe=2, tail=1, pdl=1)
# the --sweep table (every entry a separate compile, ~5-10 s each on the device)
# (offline sm_90 compile, k4v2_g128 D=128: stages 1 -> 168 registers, no spills; stages 2 -> 246: the pipeliner
#  keeps the next tile in registers; 8 warps stages 2 -> 210)
SWEEP_CONFIGS = [
    DecodeConfig(2, 2, 1, 4, 1), DecodeConfig(2, 2, 1, 4, 2), DecodeConfig(2, 2, 1, 4, 3),
    DecodeConfig(2, 2, 1, 8, 1), DecodeConfig(2, 2, 1, 8, 2), DecodeConfig(2, 2, 1, 4, 1, maxnreg=128),
    DecodeConfig(1, 2, 1, 4, 1), DecodeConfig(0, 2, 1, 4, 1),
    DecodeConfig(2, 1, 1, 4, 1),  # fp16-only keys: what the precision split costs (rel. err ~1e-3: not a default)
    # token-row tiles (layout 1): M = 128 tokens / D channels instead of the 4 query heads padded to 16
    DecodeConfig(2, 2, 1, 4, 1, layout=1), DecodeConfig(2, 2, 1, 8, 1, layout=1),
    DecodeConfig(2, 2, 1, 4, 1, maxnreg=128, layout=1),
    # pipelined tile loop: the token-row kernel has the registers for it (offline sm_90: 168 at 2 stages, no spills)
    DecodeConfig(2, 2, 1, 4, 2, layout=1), DecodeConfig(2, 2, 1, 4, 3, layout=1),
    # unmeasured candidates (offline sm_90 compile, loop SASS per 128-token tile per warp, default r128L1: 1322
    # instructions, 128 registers, 96 B spilled): n8 = N 8 (mma.sync instead of wgmma n16, half the padded fp32
    # softmax) 1122, no spills; L2 = int16-pair tiles (the byte transposes become ldmatrix) 1053; both 752
    DecodeConfig(2, 2, 1, 4, 1, maxnreg=128, layout=1, bn=8), DecodeConfig(2, 2, 1, 4, 1, maxnreg=128, layout=2),
    DecodeConfig(2, 2, 1, 4, 1, maxnreg=128, layout=2, bn=8), DecodeConfig(2, 2, 1, 4, 1, layout=2, bn=8),
    # pipe = 1 (kvarn_attention_pair_pipe_kernel, offline sm_90 per tile at r128: s2 804 instructions, 14 barriers,
    # every tile load a cp.async, 4 B spilled outside the loop; s3 15 barriers, 24 B spilled); its s2 entry replaces
    # the pair kernel's (unmeasured) s2 one, whose rK/sV/zV/cV loads and block index stayed synchronous
    DecodeConfig(2, 2, 1, 4, 2, maxnreg=128, layout=2, bn=8, pipe=1),
    DecodeConfig(2, 2, 1, 4, 3, maxnreg=128, layout=2, bn=8, pipe=1),
    # the pipe kernel without the register cap (168 registers, no spills, 3 programs / SM instead of 4): H200 0.646 ms
    # vs 0.623 for s3 r128 in one sweep. (Measured and dropped: "offset codes", planes fed to the MMAs as E + code
    # with E = 2^(10 - shift) folded into the zero points, -9% instructions, 4% faster, but rel. err 2.1e-3 with
    # E <= 256 and 2.2e-2 with every plane on the H200, against 1e-4 in the interpreter: the tensor cores' fp32
    # accumulation is not IEEE, so sums E / code times larger than the result lose the code's bits.)
    DecodeConfig(2, 2, 1, 4, 3, layout=2, bn=8, pipe=1),
    # the pipe kernel on 2 warps (each warp 32 of the 64 token / channel pair rows): offline sm_90 (triton 3.6) 1,319
    # loop instructions per warp and tile = 2,638 per tile against 4 x 814 = 3,256 on 4 warps (fewer replicated
    # softmax / scale operations), 250 registers without spills (4 programs = 8 warps per SM), 19 barriers. H200,
    # session 13, timed in turn with the default from CUDA graphs (B=64 x 16K): s3 0.959x, s2 0.961x, one run; not
    # yet timed at other shapes
    DecodeConfig(2, 2, 1, 2, 3, layout=2, bn=8, pipe=1), DecodeConfig(2, 2, 1, 2, 2, layout=2, bn=8, pipe=1),
    # those at a 200-register cap, 5 programs per SM instead of 4 (offline sm_90, triton 3.6: loop 1,354 instructions,
    # +2.7%, 56 B of stack; a 168 cap for 6 programs: 1,418, 192 B of stack); at 5 stages 7% slower than uncapped
    DecodeConfig(2, 2, 1, 2, 3, maxnreg=200, layout=2, bn=8, pipe=1),
    DecodeConfig(2, 2, 1, 2, 2, maxnreg=200, layout=2, bn=8, pipe=1),
    # a real double buffer (H200, session 14, x the old default in turn at B=64 x 16K: w4 s5 r128 1.006, w2 s5 0.843,
    # w2 s5 r200 0.904; the w2 s5 one is now DEFAULT_CONFIG). Triton 3.6's pipeliner puts the block index (an
    # indirect load) in a stage of its own; at num_stages 2-4 the tile's async copies for t + 1 are then issued at the
    # end of iteration t and waited for in full (`async_wait {num = 0}`) at the top of t + 1, so no load of a program
    # overlaps its own compute (other resident programs hide it, partly). At 5 stages the wait leaves the next tile's
    # copies in flight (num = 10 on 4 warps, 7 on 2) during the compute: offline sm_90 (triton 3.6, session 13) 4 warps
    # r128 at s5 844 loop instructions per warp (s3: 814), 31.5 KB of shared memory per program (17.8 KB), 128
    # registers, 32 B of stack; 2 warps s5 1,333, 28.8 KB, 250 registers, no stack; 2 warps s5 at a 200 cap 1,380,
    # 16 B of stack (5 programs per SM).
    # tests/test_kernels_pipelining.py checks the waits offline
    DecodeConfig(2, 2, 1, 4, 5, maxnreg=128, layout=2, bn=8, pipe=1),
    DecodeConfig(2, 2, 1, 2, 5, layout=2, bn=8, pipe=1),
    DecodeConfig(2, 2, 1, 2, 5, maxnreg=200, layout=2, bn=8, pipe=1),
    # pipe = 2 (H200, session 15: the default above; s7 the same, r200 and the 4-warp one slower). On 2 warps
    # pipe = 1's DP-wide key-scale loads (2 bytes per thread) stay synchronous global loads inside the loop, each
    # tile waiting for them before its first MMA; offline sm_90 (triton 3.6, session 14), the session-14 default: 4
    # such loads, 21 barriers, 1,349 loop instructions per warp; pipe = 2: none, 17 barriers, 1,314 (every load an
    # async copy; one q . zK reduction instead of one per plane: 22 shuffles, not 30). At 7 stages the loop keeps
    # two tiles in flight (wait num = 16; 43.5 KB of shared memory per program, 4 per SM fit); 6 compiles as 5. On 4
    # warps pipe = 1's loads were already async copies: 838 vs 844 instructions, the same 15 barriers. At a
    # 200-register cap (5 programs per SM) pipe = 2 has no spills (pipe = 1: 3 spill instructions, 7% slower than
    # uncapped): 1,339 instructions
    DecodeConfig(2, 2, 1, 2, 5, layout=2, bn=8, pipe=2), DecodeConfig(2, 2, 1, 2, 7, layout=2, bn=8, pipe=2),
    DecodeConfig(2, 2, 1, 2, 5, maxnreg=200, layout=2, bn=8, pipe=2),
    DecodeConfig(2, 2, 1, 4, 5, maxnreg=128, layout=2, bn=8, pipe=2),
    # (Measured and dropped, session 16: "pipe = 3", every key plane's q . sK operands made before the first key
    # dot, 17 -> 15 barriers per tile offline, was 1.046x the default at B=64 x 16K, 1.046x B=96, 1.03x B=8.)
    # tail = 1: the 16-bit tail's attention in Hk extra programs at the end of the records kernel's grid, not a
    # launch of its own (H200, session 16, the default's call at B=64 x 16K: records 319.8 us, tail 10.4 us alone,
    # latency-bound: 1.3 waves of 4-warp programs each waiting on three dependent loads). Offline sm_90: the record
    # loop 1,314 -> 1,330 instructions per warp and tile (integer index math), the same 17 barriers and shared memory
    DecodeConfig(2, 2, 1, 2, 5, layout=2, bn=8, pipe=2, tail=1),
    # pdl = 1: that with the rotation, records and merge kernels as programmatic dependent launches (each builds
    # its Hadamard while the previous kernel finishes); with tail = 1 the default since session 16
    DecodeConfig(2, 2, 1, 2, 5, layout=2, bn=8, pipe=2, tail=1, pdl=1),
    # voff = 1, the value codes as E + code (see DecodeConfig.voff). Offline sm_90 (triton 3.6), per warp and tile:
    # 1,330 -> 1,295 loop instructions (HADD2 320 -> 208, shifts +48, the correction's FFMA / FADD +16), the same 17
    # barriers and shared memory. H200, session 17, x default in turn: 1.002 at B=64 x 16K, 0.998 B=96, 1.025 the
    # 32B step, 0.993 B=8, 1.029 D=64 (rel. error 4.2-5.2e-4): fewer instructions bought no time; not the default
    DecodeConfig(2, 2, 1, 2, 5, layout=2, bn=8, pipe=2, tail=1, pdl=1, voff=1),
    # ksplit = 3: q x sK's fp16 hi and lo in the two column halves of one N = 8 key operand (group <= 4), the score
    # halves added by a lane shuffle: half the key MMAs, their dependent chains 8 instead of 16 deep. Offline sm_90
    # (triton 3.6), per warp and tile at group 4, D=128: 1,330 -> 1,288 loop instructions (HMMA 96 -> 64, SHFL and FADD
    # +16 each), 1,252 with voff; the same 17 barriers, registers and shared memory. D=64, group 3: 888 -> 920
    # (fewer MMAs to save there); group 8 (Qwen3-32B) runs it as ksplit 2. H200, session 18, x the then default in
    # turn: 0.941-0.952 at B=64 x 16K, 0.948 B=96, 0.958 B=8, 0.993 D=64, 0.999 32B step; with voff 0.945-0.950,
    # 0.945, 0.956, 1.003, 1.025 (no gain over ksplit 3 alone). The default since session 18
    DecodeConfig(2, 3, 1, 2, 5, layout=2, bn=8, pipe=2, tail=1, pdl=1),
    DecodeConfig(2, 3, 1, 2, 5, layout=2, bn=8, pipe=2, tail=1, pdl=1, voff=1),
    # the default at a 96-register cap, 5 programs per SM instead of 4: offline sm_90 (session 12) s3 1,736
    # instructions (+6%), 160 B of stack, 47 LDL / 63 STL in all (r128: 1,640, 24 B, 6 / 10); s2 1,688, the same
    # spills. H200, session 13 (call-by-call timing, one sweep): s3 0.7221, s2 0.7606 ms against the default's 0.5736
    DecodeConfig(2, 2, 1, 4, 3, maxnreg=96, layout=2, bn=8, pipe=1),
    DecodeConfig(2, 2, 1, 4, 2, maxnreg=96, layout=2, bn=8, pipe=1),
]
# candidates the run-time tuner times on the first eager call per key (compiles shared with the sweep)
# (the 4-warp 5-stage one for small batches: B=8 x 16K at 8 splits 0.837x the old default, the 2-warp one 1.026x)
TUNE_CONFIGS = [DEFAULT_CONFIG, DecodeConfig(2, 2, 1, 4, 5, maxnreg=128, layout=2, bn=8, pipe=1),
                DecodeConfig(2, 2, 1, 4, 3, maxnreg=128, layout=2, bn=8, pipe=1),
                DecodeConfig(2, 2, 1, 2, 3, layout=2, bn=8, pipe=1)]
TUNE_SPLIT_MULTS = (0.5, 1.0, 2.0)

_ASM_OK: dict[int, bool] = {}  # device index -> inline-PTX unpack verified
_ASM_OFF_OK: dict[int, bool] = {}  # device index -> DecodeConfig.voff's offset planes verified
_TUNED: dict[tuple, tuple[DecodeConfig, int]] = {}


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_blocks: int, device: torch.device, per_sm: int = 4,
                       min_splits: int = 2) -> int:
    """Splits per (request, KV head) from wave quantization: of the split counts from min_splits (at most 64, >= 4
    tiles per split), the smallest whose programs fill their last wave of resident slots (per_sm x SMs) to >= 95% of
    the best fill. per_sm: programs of the kernel resident per SM (occupancy, from the compiled kernel:
    programs_per_sm).
    H200, 2-warp pipe kernel (4 per SM), session 14, each x the old heuristic's choice (ceil(4 x SMs / programs),
    at least 2): B=8 x 16K, 8 heads: 8 splits (0.97 of one wave) 0.837x, 9 (1.09 waves) ~1.0x; B=96 x 16K: 2 (2.9
    waves) 0.840x, 1 (1.45) 0.958x; D=64 (6 per SM), B=64 x 8K, 3 heads: 4 splits (0.97) 0.586x, 3 (0.73) 0.681x,
    2 0.759x. One split can fill as well (B=64 x 16K: 1 and 2 within 1%; the Qwen3-32B step, B=128 x 4K: 0.853x vs
    0.883x) but was 14-25% slower for the 3-stage 4-warp kernel at B=64 (session 6): min_splits 2 for it; the 2-warp
    pipe kernels (pipe >= 2) take 1 where it fills as well (heuristic_splits): sessions 15-16, 1 split x 2 splits
    at B=64 x 16K 0.988-0.992, at the 32B step 0.906-0.970. Host-only."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
    programs = max(1, batch * kv_heads)
    slots = max(1, per_sm) * sms
    cap = int(max(1, min(64, max_blocks // 4)))
    fill = {s: (programs * s / slots) / math.ceil(programs * s / slots) for s in range(min(min_splits, cap), cap + 1)}
    best = max(fill.values())
    return next(s for s, f in fill.items() if f >= 0.95 * best)


def programs_per_sm(kernel, device: torch.device) -> int | None:
    """Resident programs per SM of a compiled Triton kernel (registers, shared memory, threads; the CUDA occupancy
    rules: registers allocated per warp in units of 256), or None where the kernel carries no register count
    (interpreter)."""
    regs, meta = getattr(kernel, "n_regs", None), getattr(kernel, "metadata", None)
    if not regs or meta is None:
        return None
    props = torch.cuda.get_device_properties(device.index or 0)
    warps = int(meta.num_warps)
    per_warp = -(-int(regs) * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // per_warp // warps
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (int(meta.shared) + 1024) if meta.shared else 32  # 1 KB per block reserved by the driver
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return int(max(1, min(by_regs, by_smem, by_threads, 32)))


# (config, record layout, padded group) -> programs per SM of its compiled records kernel, noted at its first
# launch; until then (and off CUDA) the split heuristic assumes 4
_PER_SM: dict[tuple, int] = {}


def _per_sm_key(cfg: DecodeConfig, lay, gp: int) -> tuple:
    return (cfg, lay, gp)  # frozen dataclasses: hashed by value, no name string built on the launch path


def heuristic_splits(cfg: DecodeConfig, batch: int, kv_heads: int, max_blocks: int, lay, gp: int,
                     device: torch.device) -> int:
    """default_num_splits at the occupancy of cfg's compiled kernel (4 per SM until its first launch)."""
    per_sm = _PER_SM.get(_per_sm_key(effective_config(cfg, device), lay, gp), 4)
    one_ok = cfg.layout == 2 and cfg.pipe >= 2 and cfg.num_warps == 2  # see default_num_splits
    return default_num_splits(batch, kv_heads, max_blocks, device, per_sm, 1 if one_ok else 2)


def group_geometry(hq: int, hk: int) -> tuple[int, int]:
    if hq % hk:
        raise KvarnError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    group = hq // hk
    return group, triton.next_power_of_2(group)


def effective_config(cfg: DecodeConfig, device: torch.device) -> DecodeConfig:
    """The interpreter has no inline PTX (and no pipelining): use the pure-Triton unpack there; on a GPU whose
    inline-PTX self-check failed, too."""
    if cfg.pdl and not _pdl_ok(device):
        cfg = replace(cfg, pdl=0)
    if cfg.voff and (cfg.vsplit != 1 or (device.type == "cuda" and mma_bf16() and not asm_offset_ok(device))):
        cfg = replace(cfg, voff=0)  # the correction reads the fp16-only p * sV; the offset planes' PTX self-checked
    if cfg.unpack == 2 and (not mma_bf16() or device.type != "cuda" or not asm_unpack_ok(device)):
        return replace(cfg, unpack=1)
    return cfg


def _pdl_ok(device: torch.device) -> bool:
    # programmatic dependent launch: sm_90+ hardware, not the interpreter (KVARN_PDL=0 turns it off everywhere)
    return (device.type == "cuda" and mma_bf16() and os.environ.get("KVARN_PDL", "1") != "0"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _once_per_device(cache: dict, device: torch.device, check, failed: str = "") -> bool:
    """check(device) -> bool, once per device and kept in cache; False where it raises (a PTX the driver rejects
    means: do not use it), with a warning `failed` when that run fails. It syncs, so while a stream is capturing it
    is skipped (False unless already known)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in cache:
        return cache[idx]
    if torch.cuda.is_current_stream_capturing():
        return False
    try:
        ok = bool(check(device))
    except Exception:  # noqa: BLE001
        ok = False
    cache[idx] = ok
    if not ok and failed:
        import warnings

        warnings.warn(failed)
    return ok


def _pair_planes_match(device: torch.device, off: int) -> bool:
    """pair_selftest_kernel's inline-PTX planes of every int16 pair pattern against the formula: the codes
    (off = 0), or E + code (off = 1, DecodeConfig.voff: E = 16, or 4 for the odd planes of 2-bit codes)."""
    from .attention_tokrows import pair_selftest_kernel

    i = torch.arange(1024, dtype=torch.int32, device=device)
    pairs = (i % 256) | ((i * 37 % 256) << 8)  # every byte value in both bytes
    pairs = torch.where(pairs >= 32768, pairs - 65536, pairs).to(torch.int16)
    p32 = pairs.to(torch.int32) & 0xFFFF
    even, odd = (torch.empty(pairs.shape, dtype=torch.float16, device=device) for _ in range(2))
    ok = True
    for bits in (2, 4):
        for shift in range(0, 8, bits):
            pair_selftest_kernel[(1,)](pairs, even, odd, N=pairs.numel(), SHIFT=shift, BITS=bits, OFF=off)
            e_off = (4.0 if bits == 2 and (shift // bits) % 2 else 16.0) if off else 0.0
            for got, half in ((even, 0), (odd, 8)):
                want = ((p32 >> (shift + half)) & ((1 << bits) - 1)).to(torch.float16) + e_off
                ok = ok and bool(torch.equal(got, want))
    return ok


def asm_offset_ok(device: torch.device) -> bool:
    """Check DecodeConfig.voff's inline-PTX planes (E + code), once per device (kept apart from asm_unpack_ok: a
    failure turns voff off, not the default kernel's unpack; run at a voff config's first eager call, not by
    prepare(): its compiles would lengthen every engine start for a non-default config)."""
    return _once_per_device(_ASM_OFF_OK, device, lambda dev: _pair_planes_match(dev, 1))


def _unpack_matches(device: torch.device) -> bool:
    from .attention import unpack_selftest_kernel

    src = torch.arange(256, dtype=torch.uint8, device=device).repeat(4)
    ok = True
    for bits in (2, 4):
        for shift in range(0, 8, bits):
            got = torch.empty(src.shape, dtype=torch.float16, device=device)
            unpack_selftest_kernel[(1,)](src, got, N=src.numel(), SHIFT=shift, BITS=bits)
            want = ((src.to(torch.int32) >> shift) & ((1 << bits) - 1)).to(torch.float16)
            ok = ok and bool(torch.equal(got, want))
    return ok and _pair_planes_match(device, 0)


def asm_unpack_ok(device: torch.device) -> bool:
    """Check the inline-PTX unpack against the pure-Triton one on every byte value (once per device; syncs, so it
    is skipped, and trusted only if already checked, while a stream is capturing)."""
    return _once_per_device(_ASM_OK, device, _unpack_matches,
                            "kvarn: inline-PTX code unpack failed its self-check; using the Triton unpack")


LAUNCHES = ("rotate", "records", "tail", "merge")  # run_attention's kernels, in launch order
# warps of the query rotation and the merge (each program builds the +-1 Hadamard in registers and rotates 16 rows):
# at B=64 x 32 heads one program per SM, so its instruction chain is the kernel's time (H200, session 16, 4 warps:
# rotate 4.8 us, merge 6.0 us of a 341 us call); offline sm_90, D=128, per thread: 4 warps 1,048 / 1,536
# instructions, 8 warps 664 / 968 (with the popc-built Hadamard; 1,632 / 2,176 before it)
ROT_WARPS = 8


def run_attention(q, cache, block_table, seq_lens, qsl, tail_k, tail_v, tail_slots, out, lay, group, gp, scale,
                  splits, cfg: DecodeConfig, *, prefill: bool, bq: int = 1, q_blocks: int = 1, sink_lens=None,
                  defer=False, launches=LAUNCHES):
    """The four launches shared by decode and prefill: rotate the query rows (fp32), the attention over the
    records (partials per split, rotated basis), the attention over the 16-bit tail (unrotated partial), the
    merge + rotate-back. Grids from shapes only; scratch from torch's caching allocator (graph-safe).
    launches: the subset of LAUNCHES to run (profiling: `kvarn microbench decode --breakdown` times each alone;
    the others' scratch is then left unwritten, so out is not the attention)."""
    if not set(launches) <= set(LAUNCHES):
        raise KvarnError(f"launches {tuple(launches)!r}: each must be one of {LAUNCHES}")
    N, Hq, D = q.shape
    B = seq_lens.shape[0]
    Hk = cache.shape[1]
    R = N * Hq
    sink = tail_k.shape[2] - lay.g  # the tail buffer's rows past the tile hold the first `sink` tokens (check_tail)
    if sink_lens is None:  # every row's sink rows hold its own first tokens
        sink_lens = torch.full((B,), sink, dtype=torch.int32, device=q.device) if sink else seq_lens
    dflag = defer_flag(defer, q.device, "query")  # None: no deferral (DEFER 0, the flag pointer unused)
    if dflag is True:  # deferred on every call: a per-call flag (the backend passes its persistent one)
        dflag = torch.ones(1, dtype=torch.int32, device=q.device)
    # every attention launch's (defer_ptr, DEFER): without deferral the pointer is any int32 tensor, never read
    dargs = (seq_lens, 0) if dflag is None else (dflag, 1)
    dev = q.device
    qk = float(scale) * LOG2E
    mma = mma_bf16()
    qr = torch.empty(R, D, dtype=torch.float32, device=dev)
    po_r = torch.empty(R * splits * D, dtype=torch.float32, device=dev)
    po_t = torch.empty(R * D, dtype=torch.float32, device=dev)
    plse = torch.empty(R * (splits + 1), dtype=torch.float32, device=dev)
    if "rotate" in launches:
        rotate_rows_kernel[(triton.cdiv(R, 16),)](q, qr, R, qk, q.stride(0), q.stride(1), HQ=Hq, D=D, BR=16,
                                                   MMA_BF16=mma, num_warps=ROT_WARPS, **_pdl(cfg))
    bm = max(16, bq * gp)
    # tail on tensor cores (16-bit q.k, hi/lo p.v) when compiled and the tail buffers are 16-bit (both fp16/bf16)
    tail16 = all(t.dtype in (torch.float16, torch.bfloat16) for t in (tail_k, tail_v))
    tt = (64 if D <= 128 else 32) if mma and tail16 else 16
    ts = min(tt, max(16, triton.next_power_of_2(max(1, sink))))  # the sink's <= sink rows: one step of their size
    tail = dict(args=(q, tail_k, tail_v, tail_slots, po_t, qk, q.stride(0), q.stride(1), *tail_k.stride()[:3],
                      *tail_v.stride()[:3]),
                consts=dict(GP=gp, TBM=bm, TT=tt, TS=ts, MMA_BF16=mma, TAIL16=tail16,
                            Q_AS_TAIL=q.dtype == tail_k.dtype))
    if "records" in launches and not prefill and cfg.layout in (1, 2):
        _launch_tok(qr, cache, block_table, seq_lens, sink_lens, po_r, plse, lay, group, gp, splits, cfg, Hq, mma,
                    sink, dargs, tail)
    elif "records" in launches:
        _launch_rows(qr, cache, block_table, seq_lens, qsl, sink_lens, po_r, plse, lay, group, gp, splits, cfg, Hq,
                     qk, mma, prefill, bq, bm, q_blocks, sink, dargs)
    if "tail" in launches and not _fuses_tail(cfg, cache, lay, prefill):  # else part of the records launch
        tail_attention_kernel[(B, q_blocks, Hk)](
            q, seq_lens, qsl, tail_k, tail_v, tail_slots, sink_lens, dargs[0], po_t, plse, qk, splits,
            q.stride(0), q.stride(1), tail_k.stride(0), tail_k.stride(1), tail_k.stride(2),
            tail_v.stride(0), tail_v.stride(1), tail_v.stride(2), Hq,
            GROUP=group, GP=gp, BQ=bq, BM=bm, G=lay.g, D=D, IS_PREFILL=prefill, TT=tt, MMA_BF16=mma,
            TAIL16=tail16, Q_AS_TAIL=q.dtype == tail_k.dtype, SINK=sink, DEFER=dargs[1], TS=ts, num_warps=4)
    if "merge" in launches:
        finish_kernel[(triton.cdiv(R, 16),)](po_r, po_t, plse, out, R, splits, out.stride(0), out.stride(1), HQ=Hq,
                                             D=D, BR=16, MMA_BF16=mma, num_warps=ROT_WARPS, **_pdl(cfg))
    return out


def _launch_rows(qr, cache, block_table, seq_lens, qsl, sink_lens, po_r, plse, lay, group, gp, splits, cfg, Hq, qk,
                 mma, prefill, bq, bm, q_blocks, sink, dargs):
    """Layout 0 (decode and prefill): M rows = (query token, group head) pairs, codes as the B operand."""
    B, Hk, D = seq_lens.shape[0], cache.shape[1], lay.d
    kvarn_attention_kernel[(B, q_blocks, Hk * splits)](
        qr, cache, f16_view(cache), block_table, seq_lens, qsl, sink_lens, dargs[0], po_r, plse, qk, splits,
        block_table.stride(0), cache.stride(0), cache.stride(1), Hq,
        GROUP=group, GP=gp, BQ=bq, BM=bm, G=lay.g, D=D, KB=lay.kb, VB=lay.vb,
        OFF_PK=lay.pk, OFF_SK=lay.sk, OFF_ZK=lay.zk, OFF_RK=lay.rk,
        OFF_PV=lay.pv, OFF_SV=lay.sv, OFF_ZV=lay.zv, OFF_CV=lay.cv,
        IS_PREFILL=prefill, MMA_BF16=mma,
        UNPACK=cfg.unpack, KSPLIT=min(cfg.ksplit, 2), VSPLIT=cfg.vsplit, STAGES=cfg.num_stages, SINK=sink,
        DEFER=dargs[1], num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and mma else {}),
    )


def tok_warps(lay, num_warps: int) -> int:
    """Warps of a layout-1 program: every warp owns >= 16 distinct M rows of its dots (M = g tokens for keys, D
    channels for values; more warps would broadcast warpgroups over the same rows, cf. prefill.max_warps_for_rows)."""
    return min(num_warps, max(4, min(lay.g, lay.d) // 16))


def _pdl(cfg: DecodeConfig) -> dict:
    # a PDL-aware kernel's launch arguments (cfg already through effective_config: pdl only where it runs)
    return {"PDL": 1, "launch_pdl": True} if cfg.pdl else {}


def _pipe_ok(cfg: DecodeConfig, cache, lay) -> bool:
    """Layout 2 with pipe >= 1 runs kvarn_attention_pair_pipe_kernel, which reads the scale runs as int32: it needs
    4-byte aligned records (always, for torch-allocated caches and the record sizes of docs/format.md; else the plain
    pair kernel runs)."""
    return bool(cfg.layout == 2 and cfg.pipe and cache.data_ptr() % 4 == 0 and cache.stride(0) % 4 == 0
                and cache.stride(1) % 4 == 0 and all(o % 4 == 0 for o in (lay.rk, lay.sv, lay.zv, lay.cv)))


def folded_ksplit(cfg: DecodeConfig, bn: int, group: int) -> int:
    """The pipe kernel's KSPLIT: 3 (hi / lo in the column halves of one N = 8 key operand) only where the group fits
    in half the columns; else the two-MMA split it stands for."""
    return 3 if cfg.ksplit == 3 and bn == 8 and 2 * group <= bn else min(cfg.ksplit, 2)


def _fuses_tail(cfg: DecodeConfig, cache, lay, prefill: bool) -> bool:
    """Whether the records launch also runs the tail's programs (DecodeConfig.tail on the pipe kernel, decode)."""
    return bool(cfg.tail and not prefill and _pipe_ok(cfg, cache, lay))


def _launch_tok(qr, cache, block_table, seq_lens, sink_lens, po_r, plse, lay, group, gp, splits, cfg, Hq, mma,
                sink, dargs, tail):
    """Layouts 1 / 2 (decode only): M = tokens (keys) / channels (values), the group's query heads as N. tail:
    run_attention's tail arguments, for a config that runs the tail in this launch (_fuses_tail)."""
    B, Hk = seq_lens.shape[0], cache.shape[1]
    bn = max(cfg.bn, gp) if cfg.bn else max(16, gp)
    common = dict(GROUP=group, BN=bn, G=lay.g, D=lay.d, KB=lay.kb, VB=lay.vb,
                  OFF_PK=lay.pk, OFF_SK=lay.sk, OFF_ZK=lay.zk, OFF_RK=lay.rk,
                  OFF_PV=lay.pv, OFF_SV=lay.sv, OFF_ZV=lay.zv, OFF_CV=lay.cv,
                  UNPACK=cfg.unpack, KSPLIT=min(cfg.ksplit, 2), VSPLIT=cfg.vsplit, STAGES=cfg.num_stages, SINK=sink,
                  DEFER=dargs[1], num_stages=cfg.num_stages,
                  **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and mma else {}))
    if cfg.layout == 2 and _pipe_ok(cfg, cache, lay):  # int16 pairs: M = g/2 token pairs, d/2 channel pairs
        fused = bool(cfg.tail)
        compiled = kvarn_attention_pair_pipe_kernel[(B, 1, Hk * (splits + fused))](
            qr, f16_view(cache), block_table, seq_lens, sink_lens, dargs[0], po_r, plse, splits,
            block_table.stride(0), cache.stride(0) // 2, cache.stride(1) // 2, Hq, *tail["args"],
            num_warps=min(cfg.num_warps, max(4, min(lay.g, lay.d) // 32)), SKV=max(cfg.pipe - 1, 0),
            TAIL=int(fused), VOFF=cfg.voff, **tail["consts"], **_pdl(cfg),
            **{**common, "KSPLIT": folded_ksplit(cfg, bn, group)})
    elif cfg.layout == 2:  # offsets in 2-byte units
        compiled = kvarn_attention_pair_kernel[(B, 1, Hk * splits)](
            qr, f16_view(cache), block_table, seq_lens, sink_lens, dargs[0], po_r, plse, splits,
            block_table.stride(0), cache.stride(0) // 2, cache.stride(1) // 2, Hq,
            num_warps=min(cfg.num_warps, max(4, min(lay.g, lay.d) // 32)), **common)
    else:
        compiled = kvarn_attention_tok_kernel[(B, 1, Hk * splits)](
            qr, cache, f16_view(cache), block_table, seq_lens, sink_lens, dargs[0], po_r, plse, splits,
            block_table.stride(0), cache.stride(0), cache.stride(1), Hq,
            num_warps=tok_warps(lay, cfg.num_warps), **common)
    key = _per_sm_key(cfg, lay, gp)
    if key not in _PER_SM and qr.device.type == "cuda":
        n = programs_per_sm(compiled, qr.device)
        if n:
            _PER_SM[key] = n


def _launch(q, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, out, lay, group, gp, scale, splits,
            cfg: DecodeConfig, sink_lens=None, defer=False, launches=LAUNCHES):
    return run_attention(q, cache, block_table, seq_lens, seq_lens, tail_k, tail_v, tail_slots, out, lay, group, gp,
                         scale, splits, cfg, prefill=False, sink_lens=sink_lens, defer=defer, launches=launches)


def _tune_key(q, cache, block_table, lay, group):
    B, _, D = q.shape
    return (D, lay.g, lay.kb, lay.vb, group, q.dtype, triton.next_power_of_2(max(1, block_table.shape[1])),
            triton.next_power_of_2(max(1, B * cache.shape[1])), q.device.index)


def _autotune(args, lay, group, gp, scale, base_splits, max_blocks, key):
    """Time TUNE_CONFIGS x split multipliers on the real inputs (eager, before capture); keep the fastest."""
    q = args[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    best = None
    for cfg0 in TUNE_CONFIGS:
        cfg = effective_config(cfg0, q.device)
        for mult in TUNE_SPLIT_MULTS:
            splits = int(max(1, min(64, max_blocks, round(base_splits * mult))))
            try:
                fn = functools.partial(_launch, *args, out, lay, group, gp, scale, splits, cfg)
                fn()  # compile
                torch.cuda.synchronize(q.device)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
                for _ in range(5):
                    fn()
                ev[1].record()
                ev[1].synchronize()
                ms = ev[0].elapsed_time(ev[1]) / 5
            except Exception:  # noqa: BLE001 - a variant that does not compile here is simply not a candidate
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg, splits)
    if best is not None:
        _TUNED[key] = (best[1], best[2])
    return _TUNED.get(key)


def tuned_entries() -> dict:
    """The tuner's choices so far: {key: (config name, num_splits)} (for logs / microbench)."""
    return {k: (c.name, s) for k, (c, s) in _TUNED.items()}



def check_attention_args(q, cache, block_table, tail_k, tail_v, fmt, batch: int, out, rows: str):
    """Checks shared by decode and prefill; returns (q contiguous in D, out, layout, Hk, group, padded group)."""
    if q.dim() != 3:
        raise KvarnError(f"q must be [{rows}, Hq, D], got {tuple(q.shape)}")
    _, Hq, D = q.shape
    lay = layout(as_format(fmt), D)
    check_cache(cache, lay)
    Hk = cache.shape[1]
    group, gp = group_geometry(Hq, Hk)
    check_tail(tail_k, tail_v, Hk, lay.g, D)
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise KvarnError(f"block_table must be [B={batch}, max_blocks], got {tuple(block_table.shape)}")
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q, out, lay, Hk, group, gp


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     tail_k: torch.Tensor, tail_v: torch.Tensor, tail_slots: torch.Tensor, fmt: KVFormat | str,
                     scale: float, num_splits: int | None = None, out: torch.Tensor | None = None, *,
                     config: DecodeConfig | None = None, sink_lens: torch.Tensor | None = None,
                     defer=False, launches=LAUNCHES) -> torch.Tensor:
    B = q.shape[0] if q.dim() == 3 else -1
    q, out, lay, Hk, group, gp = check_attention_args(q, cache, block_table, tail_k, tail_v, fmt, B, out, "B")
    if B == 0:
        return out
    max_blocks = block_table.shape[1]
    base_splits = heuristic_splits(config or DEFAULT_CONFIG, B, Hk, max_blocks, lay, gp, q.device)
    args = (q, cache, block_table, seq_lens, tail_k, tail_v, tail_slots)
    if config is None:
        cfg, splits = DEFAULT_CONFIG, base_splits
        if q.device.type == "cuda" and mma_bf16():
            key = _tune_key(q, cache, block_table, lay, group)
            hit = _TUNED.get(key)
            if hit is None and os.environ.get("KVARN_AUTOTUNE", "1") != "0" \
                    and not torch.cuda.is_current_stream_capturing():
                hit = _autotune(args, lay, group, gp, scale, base_splits, max_blocks, key)
            if hit is not None:
                cfg, splits = hit
    else:
        cfg = config
        splits = int(max(1, min(64, max_blocks, round(base_splits * cfg.split_mult))))
    if num_splits is not None:
        splits = int(max(1, num_splits))
    return _launch(*args, out, lay, group, gp, scale, splits, effective_config(cfg, q.device), sink_lens, defer,
                   launches)
