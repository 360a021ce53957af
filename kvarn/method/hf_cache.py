"""A transformers Cache that stores K/V through any codec of kvarn.method.codecs (real packed bytes).

Semantics shared with the vLLM backend (keep exactly):
* Full storage units (KVarN tiles of g tokens at absolute positions 0, g, 2g, ...; single tokens for the other
  formats) are encoded once, when they fill, and kept only in encoded form.
* The unfinished tile stays 16-bit (the model's dtype) in a tail buffer; optionally the first `sink_tokens`
  tokens are also kept 16-bit for good and override their dequantized copy on read. With a sink, the last
  `window_tokens` positions of the tile before the newest position's tile are read 16-bit too (the window).
* A forward whose context is empty (first chunk) attends to its own raw K/V (exact, like vLLM's first-chunk
  prefill). A later chunk of several tokens attends to the cache state after its tokens were stored (all encoded
  units decoded again, read back on every step as in serving, then the 16-bit tail) for the positions before it,
  and to its own raw K/V for its own positions: the quantized prefix plus the chunk's own raw tokens, as the
  backend's dense prefill path does. A forward of at most `codec.stored_chunk` tokens (1: a decode step; 128 for
  TurboQuant, whose vLLM backend runs such chunks through its decode kernel) reads the stored state everywhere.
Layers the format keeps 16-bit (TurboQuant's first/last 2) use the identity codec.
Usable as `model.generate(..., past_key_values=cache)` and in a plain forward loop. No beam search / cropping.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..errors import KvarnError
from .codecs import Codec, IdentityCodec, get_codec, payload_bytes, storage_bytes as _nbytes



def cache_kwarg(model) -> str:
    """The forward's cache argument: transformers 5.2x renamed `past_key_values` to `cache`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class CodecLayer(DynamicLayer):
    is_croppable = False

    def __init__(self, codec: Codec, sink_tokens: int = 0, keep_decoded: bool = False, window_tokens: int = 0):
        super().__init__()
        self.codec = codec
        self.sink_tokens = int(sink_tokens)
        self.window_tokens = int(window_tokens) if self.sink_tokens and codec.tile > 1 else 0
        # keep_decoded: also hold each unit's decoded copy so it is decoded once, not on every step. Decoding is
        # deterministic, so results are identical; it trades the memory saving for speed (fidelity runs).
        self.keep_decoded = keep_decoded
        self.decoded: list[tuple] = []
        self.payloads: list[dict] = []
        self.sink_k = self.sink_v = None
        self.windows: dict[int, tuple] = {}  # tile index -> its last window_tokens raw K/V (the last two tiles)
        self.length = 0

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.dtype = key_states.dtype
        # `keys`/`values` hold the 16-bit tail (tokens not yet in a full unit)
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.length == 0
        start = self.length
        self.length += key_states.shape[-2]
        if self.sink_tokens and start < self.sink_tokens:
            n = self.sink_tokens - start
            ks, vs = key_states[..., :n, :], value_states[..., :n, :]
            self.sink_k = ks if self.sink_k is None else torch.cat([self.sink_k, ks], -2)
            self.sink_v = vs if self.sink_v is None else torch.cat([self.sink_v, vs], -2)
        tk = torch.cat([self.keys, key_states], -2)
        tv = torch.cat([self.values, value_states], -2)
        full = tk.shape[-2] // self.codec.tile * self.codec.tile
        if full:
            self.payloads.append(self.codec.encode(tk[..., :full, :], tv[..., :full, :]))
            if self.window_tokens:
                g, w = self.codec.tile, self.window_tokens
                t0 = (start - (tk.shape[-2] - key_states.shape[-2])) // g  # index of the tile tk starts with
                for i in range(max(0, full // g - 2), full // g):
                    e = (i + 1) * g
                    self.windows[t0 + i] = (tk[..., e - w:e, :].clone(), tv[..., e - w:e, :].clone())
                for old in [t for t in self.windows if t < t0 + full // g - 2]:
                    del self.windows[old]
        self.keys, self.values = tk[..., full:, :].contiguous(), tv[..., full:, :].contiguous()
        if first:
            return key_states, value_states
        k, v = self.read()
        n = key_states.shape[-2]
        if n > self.codec.stored_chunk:  # a long chunk reads its own tokens raw (the prefix stays as stored)
            k = torch.cat([k[..., :-n, :], key_states], -2)
            v = torch.cat([v[..., :-n, :], value_states], -2)
        return k, v

    def read(self):
        """The whole cache as the attention sees it: decoded units + 16-bit tail (+ 16-bit sink)."""
        ks, vs = [], []
        for i, p in enumerate(self.payloads):
            if i < len(self.decoded):
                k, v = self.decoded[i]
            else:
                k, v = self.codec.decode(p)
                k, v = k.to(self.dtype), v.to(self.dtype)
                if self.keep_decoded:
                    self.decoded.append((k, v))
            ks.append(k)
            vs.append(v)
        k = torch.cat(ks + [self.keys], -2)
        v = torch.cat(vs + [self.values], -2)
        t = (self.length - 1) // self.codec.tile - 1  # the tile before the newest position's: its window 16-bit
        if self.window_tokens and t in self.windows:
            wk, wv = self.windows[t]
            e = (t + 1) * self.codec.tile
            k = torch.cat([k[..., :e - wk.shape[-2], :], wk.to(k.dtype), k[..., e:, :]], -2)
            v = torch.cat([v[..., :e - wv.shape[-2], :], wv.to(v.dtype), v[..., e:, :]], -2)
        if self.sink_k is not None:
            n = self.sink_k.shape[-2]
            k = torch.cat([self.sink_k, k[..., n:, :]], -2)
            v = torch.cat([self.sink_v, v[..., n:, :]], -2)
        return k, v

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.payloads, self.decoded, self.sink_k, self.sink_v, self.length = [], [], None, None, 0
        self.windows = {}
        self.keys = self.values = None
        self.is_initialized = False

    def memory_bytes(self) -> dict:
        return {"packed": sum(payload_bytes(p) for p in self.payloads),
                "decoded": sum(_nbytes(k) + _nbytes(v) for k, v in self.decoded),
                "tail": _nbytes(self.keys) + _nbytes(self.values),
                "sink": _nbytes(self.sink_k) + _nbytes(self.sink_v),
                "window": sum(_nbytes(k) + _nbytes(v) for k, v in self.windows.values())}

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("KVCodecCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVCodecCache cannot be cropped")


class KVCodecCache(Cache):
    """Cache for `num_layers` decoder layers storing K/V with `codec` (a name or a Codec)."""

    def __init__(self, codec: str | Codec, num_layers: int | None = None, config=None, sink_tokens: int | None = None,
                 keep_decoded: bool = False):
        if isinstance(codec, str):
            codec = get_codec(codec)
        if num_layers is None:
            if config is None:
                raise KvarnError("KVCodecCache needs num_layers or a model config")
            num_layers = config.get_text_config(decoder=True).num_hidden_layers
        if sink_tokens is None:
            sink_tokens = codec.fmt.sink_tokens
        if sink_tokens < 0:
            raise KvarnError(f"sink tokens must be >= 0, got {sink_tokens}")
        self.codec, self.sink_tokens = codec, int(sink_tokens)
        ident = IdentityCodec("auto", codec.fmt)
        layers = [CodecLayer(ident if codec.is_16bit_layer(i, num_layers) else codec, self.sink_tokens, keep_decoded,
                             codec.fmt.window_tokens) for i in range(num_layers)]
        super().__init__(layers=layers)

    def memory_bytes(self) -> dict:
        """Bytes held now: packed (encoded units), tail (16-bit unfinished tile), sink, window (the last two tiles'
        window tokens), decoded (keep_decoded copies; 0 by default), total."""
        out = {"packed": 0, "decoded": 0, "tail": 0, "sink": 0, "window": 0}
        for layer in self.layers:
            for k, b in layer.memory_bytes().items():
                out[k] += b
        out["total"] = sum(out.values())
        return out
