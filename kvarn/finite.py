"""A NaN is never a result: the model dtype flag (`--dtype`, vLLM's names) and a watch that says where a forward of
the transformers engine first went non-finite.

FiniteWatch hooks every module of the model; each hook keeps a device-side flag (no sync) saying whether that
module's output was finite. Only when a forward's logits are not finite are the flags read, in execution order, so
the error names the first module that overflowed (e.g. `model.layers.1.mlp.down_proj`), the format and the step.
"""
from __future__ import annotations

from .errors import KvarnError, choices

DTYPES = ("auto", "float16", "bfloat16", "float32")  # `auto`: the dtype in the model's config, as vLLM's --dtype


class NonFiniteError(KvarnError):
    """A forward produced inf / NaN: the run failed (exit 1), it is not a result and not bad input."""

    exit_code = 1


def parse_dtype(value: str | None, flag: str = "--dtype") -> str | None:
    """A --dtype value (case-insensitive), None when not given; one line naming the accepted values otherwise."""
    if value is None:
        return None
    v = str(value).strip().lower()
    if v not in DTYPES:
        raise KvarnError(f"unknown {flag} {value!r}; accepted: {choices(DTYPES)} (auto: the model config's dtype)")
    return v


def torch_dtype(name: str | None):
    """The torch dtype of a --dtype value; None for `auto` / unset (transformers then reads the config)."""
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(name or "auto")


def load_dtype(name: str | None):
    """What to hand transformers' from_pretrained(dtype=...): None when not given (its default), "auto" for auto
    (the config's dtype), else the torch dtype."""
    if name is None:
        return None
    return "auto" if name == "auto" else torch_dtype(name)


def dtype_name(model) -> str:
    """The dtype a loaded model runs in, by its --dtype name."""
    return str(getattr(model, "dtype", "")).replace("torch.", "")


def all_finite(t):
    """A 0-dim bool tensor on t's device (no sync): every element of t is finite. One aminmax pass (a NaN propagates
    to both bounds, an infinity lands in one), several times cheaper than isfinite(t).all() on a CPU."""
    import torch

    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _first_tensor(out):
    import torch

    if torch.is_tensor(out):
        return out
    if isinstance(out, (tuple, list)):
        for x in out:
            if torch.is_tensor(x):
                return x
    return getattr(out, "last_hidden_state", None) if not isinstance(out, (tuple, list)) else None


class FiniteWatch:
    """Use as a context manager around forwards of `model`; call check(logits, what) after each one.

    `layers_only`: hook the decoder layers and the top-level modules only (tens of hooks, not one per linear
    layer), for timed loops; the error then names the layer rather than the module inside it."""

    def __init__(self, model, layers_only: bool = False):
        self.model = model
        self.layers_only = layers_only
        self.flags: list = []
        self.handles = []

    def _watched(self, name: str) -> bool:
        if not name:
            return False
        return not self.layers_only or name.split(".")[-1].isdigit() or name.count(".") <= 1

    def __enter__(self):
        for name, mod in self.model.named_modules():
            if self._watched(name):
                self.handles.append(mod.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.flags.clear()

    def _hook(self, name: str):
        import torch

        def hook(module, args, out):
            t = _first_tensor(out)
            if t is not None and torch.is_tensor(t) and t.is_floating_point():
                self.flags.append((name, all_finite(t)))

        return hook

    def first_bad(self) -> str | None:
        for name, ok in self.flags:
            if not bool(ok):
                return name
        return None

    def check(self, logits, what: str) -> None:
        """Raise NonFiniteError naming `what` (format, step) and the first non-finite module when `logits` hold
        inf or NaN; forget this forward's flags either way."""
        try:
            if bool(all_finite(logits)):
                return
            where = self.first_bad()
        finally:
            self.flags.clear()
        raise NonFiniteError(nonfinite_message(what, where, dtype_name(self.model)))


def nonfinite_message(what: str, where: str | None, dtype: str) -> str:
    at = f": the first non-finite output is {where}'s" if where else ""
    hint = (" (float16 overflows above 65504: try --dtype bfloat16 or --dtype float32)" if dtype == "float16" else
            " (try --dtype float32)" if dtype == "bfloat16" else "")
    return f"non-finite logits {what}{at}; the model runs in {dtype}{hint}; no result recorded for it"


def check_metric(value: float, what: str) -> float:
    """A finished metric (perplexity, KL) that is inf / NaN is an error, not a number to store."""
    import math

    if value is None or not math.isfinite(float(value)):
        raise NonFiniteError(f"{what} is {value} (non-finite); no result recorded for it")
    return value
