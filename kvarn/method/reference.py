"""PyTorch reference of the KVarN tile quantizer: the oracle for the byte layout in docs/format.md.

Everything is batched over leading dims (no Python loop per tile), runs in fp32 and is deterministic on any
device. Shapes: k, v are [..., g, D] (token rows, channel columns); records are uint8 [..., record_bytes(D)].
"""
from __future__ import annotations

import math

import torch

from ..errors import KvarnError
from ..formats import DEFAULT_BALANCE_ITERS, KVFormat
from .hadamard import hadamard

FP16_MAX = 65504.0
EPS = 1e-12  # guards divisions by a zero rounding scale or column factor
STD_MIN, STD_MAX = 1e-3, 1e3  # clamp of the measured std per balancing step
LOG_MIN, LOG_MAX = -0.3, 10.0  # clip of the accumulated log-scales
CLIP_STEPS, CLIP_STEP = 11, 0.05  # value rows try their range shrunk toward zero by 0, 5, ..., 50%
GAIN_MIN, GAIN_MAX = 0.5, 2.0  # guard of the value rows' gain correction
TIE_TOL = 1e-5  # relative margin a narrower value range must win by

# ---------------------------------------------------------------------------------------------------------------
# layout


def _layout(fmt: KVFormat, d: int) -> list[tuple[str, int, int]]:
    """(field, byte offset, byte length) in record order, exactly as docs/format.md."""
    _check_fmt(fmt, d)
    g, kb, vb = fmt.group, int(fmt.key_bits), int(fmt.value_bits)
    sizes = [("PK", d * g * kb // 8), ("sK", 2 * d), ("zK", 2 * d), ("rK", 2 * g),
             ("PV", g * d * vb // 8), ("sV", 2 * g), ("zV", 2 * g), ("cV", 2 * d)]
    out, off = [], 0
    for name, n in sizes:
        out.append((name, off, n))
        off += n
    return out


def _check_fmt(fmt: KVFormat, d: int) -> None:
    if fmt.family != "kvarn":
        raise KvarnError(f"{fmt.name} is not a KVarN format")
    if d < 8 or d & (d - 1):
        raise KvarnError(f"head dim must be a power of two >= 8, got {d}")


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Planar pack along dim -2: out[i, c] holds q[i + j*R/per, c] in bits [j*bits, (j+1)*bits)."""
    per = 8 // bits
    r = q.shape[-2]
    q = q.to(torch.int32).reshape(*q.shape[:-2], per, r // per, q.shape[-1])
    shifts = (torch.arange(per, device=q.device, dtype=torch.int32) * bits).view(per, 1, 1)
    return (q << shifts).sum(dim=-3).to(torch.uint8)


def _unpack_codes(p: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = (torch.arange(per, device=p.device, dtype=torch.int32) * bits).view(per, 1, 1)
    q = (p.to(torch.int32).unsqueeze(-3) >> shifts) & ((1 << bits) - 1)  # [..., per, R/per, C]
    return q.reshape(*p.shape[:-2], per * p.shape[-2], p.shape[-1]).to(torch.uint8)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    x = torch.nan_to_num(x.float(), nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX).clamp(-FP16_MAX, FP16_MAX)
    return x.to(torch.float16).contiguous().view(torch.uint8)  # little-endian hosts only (x86, arm64)


def pack_records(fields: dict, fmt: KVFormat, D: int) -> torch.Tensor:
    """Inverse of unpack_records: int codes + float vectors (rounded to fp16) -> uint8 records."""
    lay = _layout(fmt, D)
    kb, vb = int(fmt.key_bits), int(fmt.value_bits)
    parts = []
    for name, _off, n in lay:
        if name == "PK":
            b = _pack_codes(fields["qK"], kb)
        elif name == "PV":
            b = _pack_codes(fields["qV"], vb)
        else:
            b = _f16_bytes(fields[name])
        b = b.reshape(*b.shape[: b.dim() - (2 if name in ("PK", "PV") else 1)], -1)
        assert b.shape[-1] == n, (name, b.shape, n)
        parts.append(b)
    rec = torch.cat(parts, dim=-1)
    pad = fmt.record_bytes(D) - rec.shape[-1]
    if pad:
        rec = torch.cat([rec, rec.new_zeros(*rec.shape[:-1], pad)], dim=-1)
    return rec


def unpack_records(records: torch.Tensor, fmt: KVFormat, D: int) -> dict:
    """uint8 records [..., R] -> qK [...,D,g] uint8, sK,zK [...,D], rK [...,g], qV [...,g,D] uint8,
    sV,zV [...,g], cV [...,D] (vectors float32 from the stored fp16)."""
    if records.dtype != torch.uint8 or records.shape[-1] != fmt.record_bytes(D):
        raise KvarnError(f"records must be uint8 [..., {fmt.record_bytes(D)}] for {fmt.name} at D={D}, "
                         f"got {records.dtype} {tuple(records.shape)}")
    g, kb, vb = fmt.group, int(fmt.key_bits), int(fmt.value_bits)
    lead = records.shape[:-1]
    out = {}
    for name, off, n in _layout(fmt, D):
        b = records[..., off:off + n].contiguous()
        if name == "PK":
            out["qK"] = _unpack_codes(b.reshape(*lead, D * kb // 8, g), kb)
        elif name == "PV":
            out["qV"] = _unpack_codes(b.reshape(*lead, g * vb // 8, D), vb)
        else:
            out[name] = b.view(torch.float16).float()
    return out


# ---------------------------------------------------------------------------------------------------------------
# method


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """fp32 copy with NaN -> 0 and +-Inf / out-of-range values clamped to the fp16 finite range."""
    x = torch.nan_to_num(x.float(), nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
    return x.clamp(-FP16_MAX, FP16_MAX)


def _std(x: torch.Tensor, dim: int) -> torch.Tensor:
    # population std (divide by n), clamped as the method says; two-pass by hand (torch.std is ~10x slower on CPU)
    c = x - x.mean(dim, keepdim=True)
    return c.square().mean(dim).sqrt().clamp(STD_MIN, STD_MAX)


def balance(x: torch.Tensor, iters: int = DEFAULT_BALANCE_ITERS, keep_best: bool = True):
    """Sinkhorn-like variance balancing of x [..., R, C] (fp32). Returns log-scales (lr [..., R], lc [..., C])
    such that x / exp(lc) / exp(lr) has rows and columns of similar std."""
    lr = x.new_zeros(x.shape[:-1])
    lc = x.new_zeros(*x.shape[:-2], x.shape[-1])
    if iters <= 0:
        return lr, lc
    best_lr, best_lc = lr, lc
    best = torch.full(x.shape[:-2], float("inf"), device=x.device)

    def cur():  # the balanced tile x / exp(lc) / exp(lr)
        return x * (-lc).exp().unsqueeze(-2) * (-lr).exp().unsqueeze(-1)

    for _ in range(iters):
        lc = (lc + _std(cur(), -2).log()).clamp(LOG_MIN, LOG_MAX)  # column std over rows
        lr = (lr + _std(cur(), -1).log()).clamp(LOG_MIN, LOG_MAX)  # row std over columns
        t = cur()
        cs, rs = _std(t, -2), _std(t, -1)
        imb = cs.amax(-1) / cs.amin(-1) + rs.amax(-1) / rs.amin(-1)
        if keep_best:
            better = imb < best  # strict: ties keep the earlier iterate (deterministic)
            best = torch.where(better, imb, best)
            best_lr = torch.where(better.unsqueeze(-1), lr, best_lr)
            best_lc = torch.where(better.unsqueeze(-1), lc, best_lc)
        else:
            best_lr, best_lc = lr, lc
    return best_lr, best_lc


def _value_range(t: torch.Tensor, w: torch.Tensor, qmax: int):
    """Rounding range and gain per row of the balanced value tile t [..., R, C] (w [..., C]: the squared column
    factors, so sums are in the stored basis). Attention averages the values of many tokens: their rounding noise
    mostly cancels, a gain common to all of them does not. Min-max rounding at 2 bits leaves most entries a large
    step from a level; a narrower range halves that noise but rounds the largest entries toward zero, which shrinks
    every token's value by several percent. So each row takes the range whose rounding is best correlated with it
    (the least error orthogonal to the row) and a gain on its levels that makes the rounding's projection on the row
    exact (least-squares slope 1). Returns lo, hi (the range, [..., R]) and the gain [..., R]."""
    mn, mx = t.amin(-1), t.amax(-1)
    w = w.unsqueeze(-2)
    best = torch.full_like(mn, -1.0)
    lo_b, hi_b, ip_b = mn, mx, torch.zeros_like(mn)
    for i in range(CLIP_STEPS):
        a = 1.0 - CLIP_STEP * i  # a = 1, 0.95, ..., 0.5
        lo, hi = mn * a, mx * a
        sc = (hi - lo) / qmax
        safe = sc > EPS
        q = ((t - lo.unsqueeze(-1)) / torch.where(safe, sc, torch.ones_like(sc)).unsqueeze(-1)).round().clamp(0, qmax)
        xh = torch.where(safe.unsqueeze(-1), q, torch.zeros_like(q)) * sc.unsqueeze(-1) + lo.unsqueeze(-1)
        ip, nh = (w * xh * t).sum(-1), (w * xh * xh).sum(-1)
        score = torch.where((ip > 0) & (nh > 0), ip * ip / nh.clamp_min(1e-30), torch.zeros_like(ip))
        # a narrower range must win by more than fp32 reduction noise: near-ties (a constant or one-hot row scores
        # the same at every factor) keep the wider range, on every device
        better = score > best * (1 + TIE_TOL)
        best = torch.where(better, score, best)
        lo_b, hi_b, ip_b = torch.where(better, lo, lo_b), torch.where(better, hi, hi_b), torch.where(better, ip, ip_b)
    nt = (w * t * t).sum(-1)
    gain = torch.where(ip_b > 0, nt / ip_b.clamp_min(1e-30), torch.ones_like(ip_b)).clamp(GAIN_MIN, GAIN_MAX)
    return lo_b, hi_b, gain


def _quantize_matrix(x: torch.Tensor, bits: int, iters: int, keep_best: bool, do_balance: bool, search: bool):
    """x [..., R, C] fp32 -> (q uint8 [..., R, C], s [..., R], z [..., R], c [..., C]) with
    x[r, c] ~= (q[r, c] * s[r] + z[r]) * c[c]; s, z, c already rounded to fp16 (returned as fp32).
    search: the value rows' range search and gain (_value_range); else min-max rounding per row."""
    lr, lc = balance(x, iters if do_balance else 0, keep_best)
    col, row = lc.exp(), lr.exp()
    t = x / col.unsqueeze(-2) / row.unsqueeze(-1)
    qmax = (1 << bits) - 1
    if search:
        mn, mx, gain = _value_range(t, col.square(), qmax)
    else:
        mn, mx, gain = t.amin(-1), t.amax(-1), None
    scale = (mx - mn) / qmax
    # fold the row balance factor into the row's rounding scale and zero; store fp16 (clamped to finite)
    s = _to_f16(scale * row)
    z = _to_f16(mn * row)
    c = _to_f16(col)
    # codes against the stored fp16 vectors, so rounding of the vectors does not bias the codes
    y = x / torch.where(c.abs() > EPS, c, torch.ones_like(c)).unsqueeze(-2)
    num = y - z.unsqueeze(-1)
    safe = s.abs() > EPS
    q = torch.where(safe.unsqueeze(-1), num / torch.where(safe, s, torch.ones_like(s)).unsqueeze(-1),
                    torch.zeros_like(num))
    q = q.round().clamp(0, qmax).to(torch.uint8)
    if gain is not None:  # the levels scaled, the codes kept
        s, z = _to_f16(s * gain), _to_f16(z * gain)
    return q, s, z, c


def _to_f16(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0).clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()


def quantize_fields(k: torch.Tensor, v: torch.Tensor, fmt: KVFormat, iters: int | None = None, keep_best: bool = True,
                    rotate: bool = True, balance: bool = True, search: bool = True) -> dict:
    """The method up to (not including) bit packing: the fields of unpack_records. iters: balancing iterations
    (None: the format's balance_iters). rotate / balance / search False: ablations (search: the value rows' range
    search and gain, _value_range)."""
    if iters is None:
        iters = fmt.balance_iters
    if k.shape != v.shape or k.dim() < 2:
        raise KvarnError(f"k and v must have the same shape [..., g, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    g, d = k.shape[-2], k.shape[-1]
    _check_fmt(fmt, d)
    if g != fmt.group:
        raise KvarnError(f"{fmt.name} quantizes tiles of {fmt.group} tokens, got {g}")
    k, v = sanitize(k), sanitize(v)
    if rotate:  # values only: keys are quantized per channel, and rotating them would spread RoPE'd outliers
        v = v @ hadamard(d, v.device)
    x = k.transpose(-1, -2)  # [D, g]: rows = channels -> per-channel key quantization
    # keys keep min-max rounding: a narrower channel range lowers the largest scores, which set where attention looks
    qK, sK, zK, rK = _quantize_matrix(x, int(fmt.key_bits), iters, keep_best, balance, search=False)
    qV, sV, zV, cV = _quantize_matrix(v, int(fmt.value_bits), iters, keep_best, balance, search=search)
    return {"qK": qK, "sK": sK, "zK": zK, "rK": rK, "qV": qV, "sV": sV, "zV": zV, "cV": cV}


def quantize_tiles(k: torch.Tensor, v: torch.Tensor, fmt: KVFormat, iters: int | None = None, keep_best: bool = True,
                   rotate: bool = True, balance: bool = True, search: bool = True) -> torch.Tensor:
    """k, v [..., g, D] (fp16/bf16/fp32) -> uint8 records [..., fmt.record_bytes(D)] (docs/format.md). Values are
    rotated by Hn, keys are not. rotate=False / balance=False / search=False are ablations (records of rotate=False
    decode with dequantize_tiles(rotated=True))."""
    return pack_records(quantize_fields(k, v, fmt, iters, keep_best, rotate, balance, search), fmt, k.shape[-1])


def dequantize_fields(f: dict, rotated: bool = False):
    qK = f["qK"].float()
    x = (qK * f["sK"].unsqueeze(-1) + f["zK"].unsqueeze(-1)) * f["rK"].unsqueeze(-2)  # [..., D, g]
    k = x.transpose(-1, -2).contiguous()
    v = (f["qV"].float() * f["sV"].unsqueeze(-1) + f["zV"].unsqueeze(-1)) * f["cV"].unsqueeze(-2)
    if not rotated:
        v = v @ hadamard(v.shape[-1], v.device)  # Hn is symmetric and orthonormal: its own inverse
    return k, v


def dequantize_tiles(records: torch.Tensor, fmt: KVFormat, D: int, rotated: bool = False):
    """uint8 records -> (k, v) float32 [..., g, D]; rotated=True gives the stored basis (K as is, V @ Hn)."""
    return dequantize_fields(unpack_records(records, fmt, D), rotated)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                        causal_offset: int | None = None) -> torch.Tensor:
    """fp32 softmax attention. q [..., Hq, Tq, D], k/v [..., Hkv, Tk, D] (Hq a multiple of Hkv: GQA).
    causal_offset: query i sits at absolute position causal_offset + i and sees keys 0..that position
    (None: no mask). Returns [..., Hq, Tq, D] float32."""
    q, k, v = q.float(), k.float(), v.float()
    hq, hk = q.shape[-3], k.shape[-3]
    if hq % hk:
        raise KvarnError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=-3)
        v = v.repeat_interleave(hq // hk, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * scale
    if causal_offset is not None:
        tq, tk = q.shape[-2], k.shape[-2]
        qi = torch.arange(tq, device=q.device).unsqueeze(-1) + causal_offset
        ki = torch.arange(tk, device=q.device).unsqueeze(0)
        s = s.masked_fill(ki > qi, float("-inf"))
    return torch.softmax(s, dim=-1) @ v
