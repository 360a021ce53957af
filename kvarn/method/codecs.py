"""Every KV format with one interface, so comparisons run on identical tensors.

A codec turns K/V `[..., T, D]` into a stored payload (real packed bytes) and back:
`encode(k, v)` takes whole storage units (`tile` tokens: 1 for per-token formats, g for KVarN),
`decode(payload)` returns float32 `(k, v)`, `roundtrip(k, v)` quantizes all full units and leaves a trailing
partial tile 16-bit (as in serving). `bytes_per_token_per_head(D)` is vLLM's page accounting (kvarn.formats).

Names: every kvarn.formats name (and alias), plus ablations of KVarN that are not vLLM dtypes:
`kvarn_k4v2_g128-norot`, `-nobal`, `-lastiter`, `-minmax` (value rows rounded min-max), and the diagnostics
`-konly` / `-vonly` (only keys / only values quantized); any KVarN preset accepts these suffixes.
TurboQuant follows vLLM 0.26 (facts, not code): Sylvester-Hadamard rotation (no random signs, one matrix for all
layers) of the unit-normalized key, per-coordinate Lloyd-Max centroids for N(0, 1/D) as vLLM's numeric solver gives
them, fp16 norm, norm correction (`_nc`: the centroid vector re-normalized before the norm is applied), fp8 keys for
k8v4, values uniform asymmetric min-max per head vector with fp16 scale and zero, no QJL; first/last 2 layers stay
16-bit; a later chunk of up to 128 tokens reads its own tokens quantized (`stored_chunk`).
"""
from __future__ import annotations

import functools
import math

import torch

from ..errors import KvarnError, choices
from ..formats import REGISTRY, KVFormat, get_format
from .hadamard import hadamard
from .reference import dequantize_tiles, quantize_tiles, sanitize

ABLATIONS = {"norot": dict(rotate=False), "nobal": dict(balance=False), "lastiter": dict(keep_best=False),
             "minmax": dict(search=False),  # value rows rounded min-max, no range search and gain
             # diagnostics: quantize only the keys (values stay as given) or only the values
             "konly": dict(only="k"), "vonly": dict(only="v")}
FP8_MAX = 448.0  # e4m3fn; vLLM's fp8 cache write saturates (scale 1.0)


def storage_bytes(t: torch.Tensor | None) -> int:
    """Bytes a tensor occupies in the format: floating data wider than 16 bits counts as 16-bit (every format
    here stores 16-bit or narrower; fp32 only appears because a CPU model computes in fp32)."""
    if t is None:
        return 0
    size = min(t.element_size(), 2) if t.is_floating_point() else t.element_size()
    return t.numel() * size


def payload_bytes(payload: dict) -> int:
    return sum(storage_bytes(t) for t in payload.values() if torch.is_tensor(t))


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., n] (n*bits divisible by 8) -> bytes [..., n*bits/8], little-endian bit stream."""
    n = q.shape[-1]
    if (n * bits) % 8:
        raise KvarnError(f"cannot pack {n} codes of {bits} bits into whole bytes")
    sh = torch.arange(bits, device=q.device)
    b = (q.to(torch.int32).unsqueeze(-1) >> sh) & 1  # [..., n, bits]
    b = b.reshape(*q.shape[:-1], n * bits // 8, 8)
    return (b << torch.arange(8, device=q.device)).sum(-1).to(torch.uint8)


def unpack_bits(p: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    b = (p.to(torch.int32).unsqueeze(-1) >> torch.arange(8, device=p.device)) & 1
    b = b.reshape(*p.shape[:-1], n, bits)
    return (b << torch.arange(bits, device=p.device)).sum(-1)


class Codec:
    name: str
    fmt: KVFormat
    tile: int = 1
    # the longest later forward (chunk) whose queries read its own tokens back as stored; a longer chunk attends to
    # its own tokens raw (the dense prefill path). 1: only a decode step reads itself from the cache.
    stored_chunk: int = 1

    def __init__(self, name: str, fmt: KVFormat):
        self.name, self.fmt = name, fmt

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict:
        raise NotImplementedError

    def decode(self, payload: dict):
        raise NotImplementedError

    def bytes_per_token_per_head(self, head_dim: int) -> float:
        return self.fmt.bytes_per_token_per_head(head_dim)

    def is_16bit_layer(self, layer: int, num_layers: int) -> bool:
        return self.fmt.is_16bit_layer(layer, num_layers)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor):
        """(k_hat, v_hat) float32: full units quantized and read back, a trailing partial tile kept as is."""
        n = k.shape[-2] // self.tile * self.tile
        if n == 0:
            return k.float(), v.float()
        kh, vh = self.decode(self.encode(k[..., :n, :], v[..., :n, :]))
        if n < k.shape[-2]:
            kh = torch.cat([kh, k[..., n:, :].float()], -2)
            vh = torch.cat([vh, v[..., n:, :].float()], -2)
        return kh, vh

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"


class IdentityCodec(Codec):
    """fp16 / auto: stores the tensors as given (the model's 16-bit dtype)."""

    def encode(self, k, v):
        return {"k": k, "v": v}

    def decode(self, p):
        return p["k"].float(), p["v"].float()


class Fp8Codec(Codec):
    """fp8 e4m3 with per-tensor scale 1.0 (vLLM's default): saturating cast."""

    def encode(self, k, v):
        f = lambda x: sanitize(x).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # noqa: E731
        return {"k": f(k), "v": f(v)}

    def decode(self, p):
        return p["k"].float(), p["v"].float()


@functools.lru_cache(maxsize=None)
def lloyd_max(d: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [2^bits], boundaries [2^bits - 1]) of the Lloyd-Max scalar quantizer for N(0, 1/d), solved the way
    vLLM 0.26 solves its TurboQuant codebook, so the levels are vLLM's and not the exact optimum: levels start evenly
    spread over +-3.5 sigma, each cell's mass and first moment come from a 200-panel trapezoid rule with the outer
    cells cut at +-10.5 sigma, at most 200 Lloyd steps (stop when no level moves by 1e-10). The trapezoid rule leaves
    the outermost levels ~0.1% inside the exact ones (3-bit: 2.1503 vs 2.1519 sigma). Boundaries are the float32
    midpoints of the float32 levels, as vLLM's store kernel searches them."""
    n = 2 ** bits
    var = 1.0 / d
    s = math.sqrt(var)
    pdf = lambda x: math.exp(-x * x / (2 * var)) / math.sqrt(2 * math.pi * var)  # noqa: E731

    def trapezoid(f, a, b, panels=200):
        h = (b - a) / panels
        return h * (0.5 * (f(a) + f(b)) + sum(f(a + i * h) for i in range(1, panels)))

    lo, hi = -3.5 * s, 3.5 * s
    c = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    for _ in range(200):
        edges = [3 * lo] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [3 * hi]
        new = []
        for i in range(n):
            mass = trapezoid(pdf, edges[i], edges[i + 1])
            new.append(trapezoid(lambda x: x * pdf(x), edges[i], edges[i + 1]) / mass if mass > 1e-15 else c[i])
        if max(abs(x - y) for x, y in zip(new, c)) < 1e-10:
            break  # converged: the levels of the step before are kept
        c = new
    cent = torch.tensor(c, dtype=torch.float32)
    return cent, (cent[:-1] + cent[1:]) / 2


class TurboQuantCodec(Codec):
    # vLLM 0.26's TurboQuant backend runs a continuation chunk of at most 128 query tokens through its decode kernel
    # over the cache, which do_kv_cache_update has already written that chunk into: every query reads all its keys
    # and values, its own chunk's included, quantized. Longer chunks get the cached prefix dequantized plus their own
    # tokens raw.
    stored_chunk = 128

    def __init__(self, name, fmt):
        super().__init__(name, fmt)
        self.kb, self.vb = int(fmt.key_bits), int(fmt.value_bits)
        self.nc = name.endswith("_nc")

    # values: uniform asymmetric over the whole head vector, fp16 scale + zero (min)
    def _enc_v(self, v):
        v = sanitize(v)
        qmax = 2 ** self.vb - 1
        mn, mx = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
        scale = ((mx - mn) / qmax).clamp_min(1e-8)
        q = torch.floor((v - mn) / scale + 0.5).clamp(0, qmax)
        return pack_bits(q, self.vb), scale.half(), mn.half()

    def encode(self, k, v):
        pv, vs, vz = self._enc_v(v)
        out = {"pv": pv, "vs": vs, "vz": vz}
        if self.kb == 8:
            out["k"] = sanitize(k).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return out
        k = sanitize(k)
        d = k.shape[-1]
        norm = k.norm(dim=-1, keepdim=True)
        y = (k / (norm + 1e-8)) @ hadamard(d, k.device)
        _, bounds = lloyd_max(d, self.kb)
        idx = torch.bucketize(y, bounds.to(k.device), right=True)  # index = number of boundaries <= y
        out.update(pk=pack_bits(idx, self.kb), kn=norm.clamp(max=65504.0).half())
        return out

    def decode(self, p):
        d = p["pv"].shape[-1] * 8 // self.vb
        v = unpack_bits(p["pv"], self.vb, d).float() * p["vs"].float() + p["vz"].float()
        if self.kb == 8:
            return p["k"].float(), v
        cent, _ = lloyd_max(d, self.kb)
        c = cent.to(p["pk"].device)[unpack_bits(p["pk"], self.kb, d)]
        if self.nc:  # norm correction: the centroid vector re-normalized to unit length
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        return (c @ hadamard(d, c.device)) * p["kn"].float(), v


class KvarnCodec(Codec):
    def __init__(self, name, fmt, only: str | None = None, **opts):
        super().__init__(name, fmt)
        self.tile = fmt.group
        self.only = only  # "k" / "v": the other tensor is kept as given (diagnostic ablations)
        self.opts = opts  # ablation switches of quantize_tiles
        self.rotated_decode = opts.get("rotate", True) is False  # no rotation: records hold the original basis

    def encode(self, k, v):
        *lead, t, d = k.shape
        n, g = t // self.tile, self.tile
        rec = quantize_tiles(k.reshape(*lead, n, g, d), v.reshape(*lead, n, g, d), self.fmt, **self.opts)
        p = {"rec": rec, "d": d}
        if self.only:
            p["raw"] = v if self.only == "k" else k
        return p

    def decode(self, p):
        rec, d = p["rec"], p["d"]
        k, v = dequantize_tiles(rec, self.fmt, d, rotated=self.rotated_decode)
        lead = rec.shape[:-2]
        k, v = k.reshape(*lead, -1, d), v.reshape(*lead, -1, d)
        if self.only == "k":
            v = p["raw"].float()
        elif self.only == "v":
            k = p["raw"].float()
        return k, v


def codec_names() -> list[str]:
    names = list(REGISTRY)
    for f in REGISTRY.values():
        if f.family == "kvarn":
            names += [f"{f.name}-{a}" for a in ABLATIONS]
    return names


@functools.lru_cache(maxsize=None)
def get_codec(name: str) -> Codec:
    key = name.strip().lower()
    base, _, abl = key.partition("-")
    if abl:
        f = get_format(base) if base in REGISTRY or base in ("fp16", "fp8_e4m3") else None
        if f is None or f.family != "kvarn" or abl not in ABLATIONS:
            raise KvarnError(f"unknown codec {name!r}; accepted: {choices(codec_names())}")
        return KvarnCodec(f"{f.name}-{abl}", f, **ABLATIONS[abl])
    try:
        f = get_format(key)
    except KvarnError:
        raise KvarnError(f"unknown codec {name!r}; accepted: {choices(codec_names())}") from None
    cls = {"fp16": IdentityCodec, "fp8": Fp8Codec, "turboquant": TurboQuantCodec, "kvarn": KvarnCodec}[f.family]
    return cls(f.name, f)


def parse_codecs(spec: str | None, default: tuple[str, ...]) -> list[Codec]:
    names = [s.strip() for s in spec.split(",") if s.strip()] if spec else list(default)
    if spec and spec.strip().lower() == "all":
        names = codec_names()
    out: list[Codec] = []
    for n in names:
        c = get_codec(n)
        if c not in out:
            out.append(c)
    if not out:
        raise KvarnError("no kv dtype given")
    return out
