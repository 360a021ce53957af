"""`kvarn fidelity`: how much each KV format perturbs K/V, attention and next-token predictions.

Two measurements, all formats on identical tensors (kvarn.method.codecs):
* K/V metrics on captured tensors of every layer (one fp16 forward of the context; keys post-RoPE, as caches
  store them): key / value relative MSE, attention-output relative error ||O^ - O|| / ||O|| and attention-score
  KL(p || p^) (nats, mean over heads and sampled query positions, causal). Each format round-trips the whole
  context (full tiles quantized, a trailing partial tile 16-bit); layers the format keeps 16-bit are exact.
* With a real model, chunked perplexity: the text goes through the model in chunks of `chunk` tokens with a
  KVCodecCache, so every chunk attends to the quantized earlier ones (serving semantics, see hf_cache); all
  formats advance in lockstep with the fp16 cache, giving next-token KL(fp16 || format) and top-1 agreement.
`synthetic` needs no model: seeded K/V/Q with real-model structure (RoPE, outlier channels, a sink token).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..errors import KvarnError
from ..finite import FiniteWatch, check_metric, dtype_name, load_dtype, parse_dtype
from .codecs import Codec, IdentityCodec, parse_codecs
from .hf_cache import KVCodecCache, cache_kwarg

DEFAULT_KV = ("auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
              "kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k2v2_g128")
SYNTHETIC = "synthetic"
MOBY_START = 20_000  # characters skipped in the shipped excerpt (title pages), as in the device reference runs
N_QUERIES = 256


class _Ref:
    name = "__fp16_reference__"


REF = _Ref()


@dataclass
class LayerKV:
    q: torch.Tensor  # [Hq, n, D] at positions `pos` (sampled)
    k: torch.Tensor  # [Hkv, T, D]
    v: torch.Tensor  # [Hkv, T, D]
    pos: torch.Tensor  # [n] absolute positions of the sampled queries
    scale: float
    _ref: tuple | None = None  # fp16 attention (out, logp), computed once for all formats

    def reference(self):
        if self._ref is None:
            self._ref = _attention(self.q, self.k, self.v, self.pos, self.scale)
        return self._ref


@dataclass
class FidelityResult:
    kv_dtype: str
    bytes_per_token_per_head: float
    metrics: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)

    def as_dict(self, per_layer: bool = False) -> dict:
        d = {"kv_dtype": self.kv_dtype, "bytes_per_token_per_head": self.bytes_per_token_per_head, **self.metrics}
        if per_layer:
            d["layers"] = self.layers
        return d


# ---------------------------------------------------------------------------------------------------------------
# K/V capture


def _query_positions(t: int, first: int, n: int = N_QUERIES) -> torch.Tensor:
    lo = min(first, t - 1)
    return torch.unique(torch.linspace(lo, t - 1, min(n, t - lo)).round().long())


def synthetic_kv(layers: int = 8, t: int = 1024, hkv: int = 2, hq: int = 8, d: int = 128, seed: int = 0,
                 first: int = 128, device: str = "cpu") -> list[LayerKV]:
    """Seeded Q/K/V with the structure real models show: a few large-magnitude key channels, per-channel
    offsets, RoPE, a high-norm sink token at position 0, values with varied channel scales and outlier tokens.
    Drawn on the CPU (the same numbers for every `device`), then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    half = d // 2
    inv = 1.0 / (10000 ** (torch.arange(half).float() / half))
    ang = torch.arange(t).float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()

    def rope(x):
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    pos = _query_positions(t, first)
    out = []
    for _ in range(layers):
        chan = torch.ones(d)
        chan[torch.randperm(d, generator=g)[: d // 16]] = 8.0  # outlier channels
        bias = torch.randn(hkv, 1, d, generator=g) * 2.0
        k = torch.randn(hkv, t, d, generator=g) * chan + bias
        k[:, 0] *= 6.0  # sink token
        k = rope(k)
        v = torch.randn(hkv, t, d, generator=g) * (0.5 + torch.rand(d, generator=g) * 2)
        v[:, torch.randint(1, t, (t // 64,), generator=g)] *= 5.0  # outlier tokens
        # queries share the keys' mean direction so attention is peaky, as in trained models
        qk = bias.repeat_interleave(hq // hkv, 0) + torch.randn(hq, t, d, generator=g)
        q = rope(qk * 0.5)[:, pos]
        out.append(LayerKV(q.to(device), k.to(device), v.to(device), pos.to(device), 1.0 / math.sqrt(d)))
    return out


def capture_kv(model, ids: torch.Tensor, first: int = 128) -> list[LayerKV]:
    """One fp16-cache forward of ids [1, T]; Q (sampled positions), K, V of every attention layer."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    t = ids.shape[-1]
    pos = _query_positions(t, first)
    got: dict[int, LayerKV] = {}

    def capture(module, query, key, value, attention_mask, **kw):
        idx = getattr(module, "layer_idx", len(got))
        scale = kw.get("scaling") or getattr(module, "scaling", None) or 1.0 / math.sqrt(query.shape[-1])
        got[idx] = LayerKV(query[0][:, pos].detach().float(), key[0].detach().float(), value[0].detach().float(),
                           pos, float(scale))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kvarn_capture", capture)
    old = model.config._attn_implementation
    model.set_attn_implementation("kvarn_capture")
    try:
        with torch.no_grad(), FiniteWatch(model) as watch:
            out = model(ids, use_cache=False)
            watch.check(out.logits, f"in the K/V capture forward ({t} tokens, no cache: every format's K/V come "
                                    "from it)")
    finally:
        model.set_attn_implementation(old)
    if not got:
        raise KvarnError("no attention layer was captured (unsupported model architecture)")
    return [got[i] for i in sorted(got)]


# ---------------------------------------------------------------------------------------------------------------
# metrics


def _rel_mse(a, b) -> float:
    return float((a - b).pow(2).sum() / b.pow(2).sum().clamp_min(1e-30))


def _attention(q, k, v, pos, scale):
    """q [Hq, n, D] at positions pos; k, v [Hkv, T, D]; causal. Returns (out [Hq, n, D], logp [Hq, n, T])."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = (q @ k.transpose(-1, -2)) * scale
    mask = torch.arange(k.shape[-2], device=k.device)[None, :] > pos.to(k.device)[:, None]
    logp = torch.log_softmax(s.masked_fill(mask, float("-inf")), -1)
    return logp.exp() @ v, logp


def kv_metrics(layer: LayerKV, codec: Codec, sixteen_bit: bool = False) -> dict:
    if sixteen_bit:
        return {"k_rel_mse": 0.0, "v_rel_mse": 0.0, "out_rel_err": 0.0, "score_kl": 0.0, "sixteen_bit": True}
    kh, vh = codec.roundtrip(layer.k, layer.v)
    o, lp = layer.reference()
    oh, lph = _attention(layer.q, kh, vh, layer.pos, layer.scale)
    p = lp.exp()
    kl = (p * (lp - lph)).nan_to_num(0.0).sum(-1)  # 0 * (-inf) terms are masked keys
    return {"k_rel_mse": _rel_mse(kh, layer.k), "v_rel_mse": _rel_mse(vh, layer.v),
            "out_rel_err": float((oh - o).norm() / o.norm().clamp_min(1e-30)), "score_kl": float(kl.mean()),
            "sixteen_bit": False}


def chunked_eval(model, ids: torch.Tensor, codecs: list[Codec], chunk: int, sink: int | None = None,
                 progress=None) -> dict[str, dict]:
    """Chunked perplexity of ids [1, T] for each codec, all in lockstep with the fp16 (identity) cache.
    Returns {name: {nll_sum, n, kl_sum, top1}} (sums over predicted positions); REF holds the fp16 cache's."""
    kw = cache_kwarg(model)
    cfg = model.config
    ref = KVCodecCache(IdentityCodec("auto", codecs[0].fmt), config=cfg, sink_tokens=0)
    quant = [c for c in codecs if not isinstance(c, IdentityCodec)]
    # keep_decoded: identical numbers (decoding is deterministic), each unit decoded once instead of every chunk
    caches = {c.name: KVCodecCache(c, config=cfg, sink_tokens=sink, keep_decoded=True) for c in quant}
    acc = {c.name: {"nll_sum": 0.0, "n": 0, "kl_sum": 0.0, "top1": 0} for c in [*codecs, REF]}
    t = ids.shape[-1]
    with torch.no_grad(), FiniteWatch(model) as watch:
        for s in range(0, t, chunk):
            e = min(s + chunk, t)
            piece = ids[:, s:e]
            tgt = ids[0, s + 1:e + 1]
            m = tgt.shape[0]  # the last position of the text has no target
            step = f"chunk {s // chunk} (tokens {s}-{e - 1})"
            logits = model(piece, use_cache=True, **{kw: ref}).logits
            watch.check(logits, f"for kv dtype auto (the fp16 cache) in {step}")
            lp_ref = torch.log_softmax(logits[0, :m].float(), -1)
            nll_ref = -lp_ref.gather(-1, tgt[:, None]).sum().item()
            top_ref = lp_ref.argmax(-1)
            for c in [*codecs, REF]:
                a = acc[c.name]
                if c is REF or isinstance(c, IdentityCodec):
                    a["nll_sum"] += nll_ref
                    a["top1"] += m
                else:
                    logits = model(piece, use_cache=True, **{kw: caches[c.name]}).logits
                    watch.check(logits, f"for kv dtype {c.name} in {step}")
                    lp = torch.log_softmax(logits[0, :m].float(), -1)
                    a["nll_sum"] += -lp.gather(-1, tgt[:, None]).sum().item()
                    a["kl_sum"] += (lp_ref.exp() * (lp_ref - lp)).sum().item()
                    a["top1"] += int((lp.argmax(-1) == top_ref).sum())
                a["n"] += m
            if progress and (e // chunk) % 8 == 0 or e == t:
                progress and progress(f"  {e}/{t} tokens")
    return acc


# ---------------------------------------------------------------------------------------------------------------
# driver


def _mean(xs):
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


def available_devices() -> list[str]:
    """The --device values this machine runs: cpu, each visible CUDA GPU (cuda, cuda:N), mps where torch has it."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def parse_device(value: str, flag: str = "--device") -> str:
    """A torch device this machine has (one line naming the value and the accepted ones otherwise)."""
    here = available_devices()
    try:
        dev = torch.device(str(value).strip().lower())
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise KvarnError(f"unknown {flag} {value!r}; accepted: cpu, cuda, cuda:N, mps (here: {', '.join(here)})")
    name = "cpu" if dev.type == "cpu" else str(dev)
    if name in here:
        return name
    why = ("torch sees no CUDA GPU here" if dev.type == "cuda" and not torch.cuda.is_available() else
           f"torch sees {torch.cuda.device_count()} CUDA GPU(s)" if dev.type == "cuda" else "torch has no MPS here")
    raise KvarnError(f"{flag} {value!r}: {why}; accepted here: {', '.join(here)}")


def run_fidelity(model: str = SYNTHETIC, kv_dtypes: str | None = None, context: int | None = None, chunk: int = 128,
                 text: str | None = None, device: str = "cpu", sink: int | None = None, windows: int = 1,
                 start_char: int | None = None, log=None, dtype: str | None = None
                 ) -> tuple[list[FidelityResult], dict]:
    """Run both measurements; returns (results per format, run info). `dtype`: the model's (DTYPES; None or
    `auto`: its config's). A forward or metric that goes non-finite raises NonFiniteError naming format and step."""
    dtype = parse_dtype(dtype)
    device = parse_device(device)
    codecs = parse_codecs(kv_dtypes, DEFAULT_KV)
    if chunk < 1:
        raise KvarnError(f"--chunk must be >= 1, got {chunk}")
    if sink is not None and sink < 0:
        raise KvarnError(f"--sink must be >= 0, got {sink}")
    if windows < 1:
        raise KvarnError(f"--windows must be >= 1, got {windows}")
    log = log or (lambda msg: None)
    t0 = time.time()
    info = {"model": model, "chunk": chunk, "device": device, "sink": sink, "windows": windows}  # None: each preset's
    lm = None
    if model.strip().lower() == SYNTHETIC:
        if dtype not in (None, "float32"):
            raise KvarnError(f"--dtype {dtype} picks a real model's dtype; the synthetic K/V are float32 (give "
                             "--model smollm2-135m or a local folder)")
        context = context or 1024
        if context < 2:
            raise KvarnError(f"--context must be >= 2, got {context}")
        info.update(context=context, text="", tokens=context, dtype="float32")
        layers_kv = synthetic_kv(t=context, device=device)
        windows_ids = []
    else:
        from .textdata import MOBY_DICK, load_model, load_text

        context = context or 4096
        if context < 2:
            raise KvarnError(f"--context must be >= 2, got {context}")
        body = load_text(text)
        start = start_char if start_char is not None else (MOBY_START if not text else 0)
        log(f"loading {model} ...")
        lm, tok = load_model(model, device=device, dtype=load_dtype(dtype))
        info["dtype"] = dtype_name(lm)
        ids = tok(body[start:], return_tensors="pt").input_ids.to(device)
        need = context * windows
        if ids.shape[-1] < need:
            raise KvarnError(f"text has {ids.shape[-1]} tokens after character {start}; {windows} window(s) of "
                             f"{context} need {need} (lower --context or --windows, or give a longer --text)")
        windows_ids = [ids[:, w * context:(w + 1) * context] for w in range(windows)]
        info.update(context=context, text=str(text or MOBY_DICK.name), start_char=start, tokens=need)
        log(f"capturing K/V of {context} tokens ...")
        layers_kv = capture_kv(lm, windows_ids[0])
    n_layers = len(layers_kv)
    info["layers"] = n_layers
    results = []
    for c in codecs:
        d = layers_kv[0].k.shape[-1]
        per = []
        for i, lay in enumerate(layers_kv):
            row = kv_metrics(lay, c, sixteen_bit=c.is_16bit_layer(i, n_layers) or isinstance(c, IdentityCodec))
            per.append({"layer": i, **row})
        m = {k: check_metric(_mean(r[k] for r in per), f"{k} of kv dtype {c.name}")
             for k in ("k_rel_mse", "v_rel_mse", "out_rel_err", "score_kl")}
        results.append(FidelityResult(c.name, c.bytes_per_token_per_head(d), m, per))
        log(f"K/V metrics: {c.name}")
    if windows_ids:
        acc = {c.name: {"nll_sum": 0.0, "n": 0, "kl_sum": 0.0, "top1": 0} for c in [*codecs, REF]}
        for w, ids_w in enumerate(windows_ids):
            log(f"chunked perplexity, window {w + 1}/{len(windows_ids)} ...")
            part = chunked_eval(lm, ids_w, codecs, chunk, sink, progress=log)
            for name, a in part.items():
                for k in a:
                    acc[name][k] += a[k]
        ref_ppl = check_metric(math.exp(acc[REF.name]["nll_sum"] / acc[REF.name]["n"]), "perplexity of kv dtype auto")
        info["ppl_fp16"] = ref_ppl
        for r in results:
            a = acc[r.kv_dtype]
            ppl = check_metric(math.exp(a["nll_sum"] / a["n"]), f"perplexity of kv dtype {r.kv_dtype}")
            r.metrics["ppl"] = ppl
            r.metrics["next_token_kl"] = a["kl_sum"] / a["n"]
            r.metrics["top1_agree"] = a["top1"] / a["n"]
            r.metrics["ppl_delta_pct"] = 100.0 * (ppl / ref_ppl - 1.0)
    info["seconds"] = round(time.time() - t0, 1)
    return results, info
