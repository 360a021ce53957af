"""One log line per Triton compile of this process (ours, vLLM's and TurboQuant's kernels alike), with wall-clock
time and duration, so a stall in a serving run can be matched to a compile (KVARN_LOG_COMPILES=1: the vLLM plugin's
register() installs it in each process that loads it, i.e. vLLM's front end, engine core and workers, while the
plugin is active; `kvarn bench` sets it for its cells). TorchInductor's compile subprocesses are not covered.

    [kvarn] 03:21:07.412 triton compile _flush_layers_kernel 2.41 s (H=8 G=128 D=128 ...; 16: ktab_ptr ...)
    [kvarn] 03:21:09.020 triton compile _decode_kernel 0.01 s, disk cache (G=128 D=128 ...; 16: q_ptr ...)

(the constexpr values, then the arguments specialised as divisible by 16: what tells two variants apart)

It is Triton's compilation listener (knobs.compilation.listener, called by triton.compile() after every compile
or on-disk cache hit with its stage times), chained with a listener already set. A new specialisation of a kernel
shows up here even when the disk cache serves it.
"""
from __future__ import annotations

import sys
import threading
from datetime import datetime

_LOCK = threading.Lock()
_INSTALLED = {"done": False}


def _by_name(d: dict, names: list) -> dict:
    """Triton keys constants / attributes by argument path ((index,) for a top-level argument): by name."""
    return {names[k[0]]: v for k, v in d.items() if isinstance(k, tuple) and len(k) == 1 and 0 <= k[0] < len(names)}


def _describe(src) -> tuple[str, str]:
    """(kernel name, what tells its variants apart: the constexpr values, then the arguments specialised as
    divisible by 16 / 16-byte aligned); the plain signature where the source has no such fields."""
    name = str(getattr(src, "name", None) or type(src).__name__)
    sig = getattr(src, "signature", None)
    if not isinstance(sig, dict):
        return name, ""
    consts, attrs = getattr(src, "constants", None), getattr(src, "attrs", None)
    if not isinstance(consts, dict) or not isinstance(attrs, dict):
        return name, ", ".join(f"{k}: {v}" for k, v in sig.items())
    names = list(sig)
    # attrs has an entry per argument, [] where nothing is specialised (Triton 3.6)
    values, special = _by_name(consts, names), {n for n, v in _by_name(attrs, names).items() if v}
    const = " ".join(f"{n}={values[n]}" for n in names if n in values)
    div = " ".join(n for n in names if n in special)
    return name, const + (f"; 16: {div}" if div else "")


def listener(*, src=None, metadata=None, metadata_group=None, times=None, cache_hit=False, stream=None, **_) -> None:
    """Triton's CompilationListener: print the line (never raises: a log must not break a compile)."""
    try:
        name, args = _describe(src)
        total = getattr(times, "total", None)
        secs = f"{total / 1e6:.2f} s" if isinstance(total, (int, float)) else "? s"
        line = (f"[kvarn] {datetime.now().strftime('%H:%M:%S.%f')[:-3]} triton compile {name} {secs}"
                + (", disk cache" if cache_hit else "") + (f" ({args[:600]})" if args else ""))
        print(line, file=stream or sys.stderr, flush=True)
    except Exception:  # noqa: BLE001
        pass


def _chain(first, second):
    if first is None:
        return second

    def both(**kw):
        first(**kw)
        second(**kw)

    return both


def install() -> bool:
    """Set the listener once per process; False when this Triton has none (nothing changes)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    comp = getattr(knobs, "compilation", None)
    if comp is None or not hasattr(comp, "listener"):
        return False
    with _LOCK:
        if not _INSTALLED["done"]:
            comp.listener = _chain(comp.listener, listener)
            _INSTALLED["done"] = True
    return True
