"""One log line per Triton JIT compile of this process (any kernel: ours, vLLM's, TurboQuant's), with wall-clock
time and duration, so a stall in a serving run can be matched to a compile (KVARN_LOG_COMPILES=1; the vLLM plugin
installs it in every vLLM process, `kvarn bench` sets it for its cells).

    [kvarn] 03:21:07.412 triton compile _flush_layers_kernel 2.41 s (ktab_ptr: *i64, n_tiles: i32, ...)

Triton calls jit_cache_hook before a kernel variant is compiled (an in-memory miss; the disk cache may then serve
it in milliseconds) and jit_post_compile_hook after; both hooks are chained with any already set.
"""
from __future__ import annotations

import sys
import threading
import time
from datetime import datetime

_LOCK = threading.Lock()
_STARTS: dict = {}
_INSTALLED = {"done": False}
MIN_LOG_S = 0.0  # log every compile; a disk-cache hit shows up as ~0.0x s


def _name(fn) -> str:
    return getattr(fn, "name", None) or str(fn)


def on_start(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's keyword names
    with _LOCK:
        _STARTS[(_name(fn), str(key))] = time.perf_counter()
    return None  # a truthy return would make Triton skip the compile


def on_done(*, key, repr, fn, compile, is_manual_warmup, already_compiled, stream=None):  # noqa: A002
    with _LOCK:
        t0 = _STARTS.pop((_name(fn), str(key)), None)
    secs = time.perf_counter() - t0 if t0 is not None else float("nan")
    if secs >= MIN_LOG_S or secs != secs:
        args = repr.split("](", 1)[1][:-1] if "](" in repr else ""
        line = (f"[kvarn] {datetime.now().strftime('%H:%M:%S.%f')[:-3]} triton compile {_name(fn)} {secs:.2f} s"
                + (" (warm-up)" if is_manual_warmup else "") + (f" ({args[:400]})" if args else ""))
        print(line, file=stream or sys.stderr, flush=True)
    return None


def _chain(first, second):
    if first is None:
        return second

    def both(**kw):
        a = first(**kw)
        b = second(**kw)
        return a or b

    return both


def install() -> bool:
    """Set the hooks once per process; False when this Triton has no such hooks (nothing changes)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = getattr(knobs, "runtime", None)
    if rt is None or not hasattr(rt, "jit_cache_hook") or not hasattr(rt, "jit_post_compile_hook"):
        return False
    with _LOCK:
        if _INSTALLED["done"]:
            return True
        rt.jit_cache_hook = _chain(rt.jit_cache_hook, on_start)
        rt.jit_post_compile_hook = _chain(rt.jit_post_compile_hook, on_done)
        _INSTALLED["done"] = True
    return True
