"""How the kernels run: the jit decorator of serving kernels, the interpreter / hardware checks that pick a
kernel's fallback, where their compiles are cached, and the optional log line per Triton compile.

Compile log (KVARN_LOG_COMPILES=1; the vLLM plugin's register() installs it in each process that loads it): one
line per Triton compile of this process (ours, vLLM's and TurboQuant's kernels alike), with wall-clock time and
duration, so that a stall in a serving run can be matched to a compile:

    [kvarn] 03:21:07.412 triton compile _flush_layers_kernel 2.41 s (H=8 G=128 D=128 ...; 16: ktab_ptr ...)

(the constexpr values, then the arguments specialised as divisible by 16: what tells two variants apart). It is
Triton's compilation listener, chained with a listener already set; TorchInductor's compile subprocesses are not
covered.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from datetime import datetime

import torch
import triton


def serving_jit(ints=(), index_ptrs=()):
    """triton.jit for a kernel that serving steps launch. `ints`: arguments that change from step to step (row,
    tile and split counts, the block table's width): Triton would otherwise compile one variant for 1, one for
    multiples of 16 and one for the rest, each at its first use, mid-run (seconds each, a stall of every running
    request). `index_ptrs`: index tensors that may be slices at any offset, not specialised on 16-byte alignment
    (scalar loads: nothing to vectorise). What the engine's warm-up compiles is then what every later step runs."""
    return triton.jit(do_not_specialize=list(ints), do_not_specialize_on_alignment=list(index_ptrs))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints: triton.cdiv and triton.next_power_of_2 are constexpr functions, microseconds per call
    on the host, and a step launches every layer's kernels."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for host ints (cdiv says why)."""
    return 1 << (int(n) - 1).bit_length()


def no_launch(*_) -> None:
    """The launch a prepare_* function returns for work of no rows, tiles or records: nothing to run."""


def interpreted() -> bool:
    """True under the Triton interpreter (TRITON_INTERPRET=1, the CPU tests): no inline PTX, no libdevice, no
    bf16 tensor-core dots; the kernels then take their plain-Triton form of the same arithmetic."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def compiled() -> int:
    """The kernels' COMPILED constexpr: 1 on a GPU (tensor-core dots, inline PTX), 0 in the interpreter."""
    return 0 if interpreted() else 1


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel's programs start while the previous kernel finishes): sm_90 and
    newer, compiled only. A host query of the device's capability: no sync, safe during graph capture."""
    return device.type == "cuda" and not interpreted() and torch.cuda.get_device_capability(device)[0] >= 9


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


# ------------------------------------------------------------------------------------------------ compile log

_LOCK = threading.Lock()
_INSTALLED = {"done": False}
# TRITON_CACHE_DIR as the vLLM plugin found it at registration (dir None: unset, Triton's ~/.triton/cache)
_CACHE_DIR: dict = {"noted": False, "dir": None}


def note_compile_cache() -> None:
    """Remember where this process caches Triton compiles now. The vLLM plugin calls it at registration, before vLLM
    compiles the model and points TRITON_CACHE_DIR at a folder of its own (kernel_compile_cache says why that
    matters)."""
    with _LOCK:
        if not _CACHE_DIR["noted"]:
            _CACHE_DIR.update(noted=True, dir=os.environ.get("TRITON_CACHE_DIR"))


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextlib.contextmanager
def kernel_compile_cache():
    """Compiles inside go to the Triton cache noted at registration (note_compile_cache), not to vLLM's. During an
    engine start vLLM's compilation (its Inductor adaptor, or TorchInductor under the cache folder vLLM gives it)
    points TRITON_CACHE_DIR into its compile cache, one folder per engine configuration: kernels compiled under it
    would compile again (~20 s of an engine start) at every new max_model_len, batch or memory setting, although
    their code and shapes are the same. Triton reads the variable at each compile; nothing else of this process
    compiles meanwhile (the engine start runs the warm-up alone). Nothing noted (no plugin): no change."""
    if not _CACHE_DIR["noted"]:
        yield
        return
    before = os.environ.get("TRITON_CACHE_DIR")
    _set_env("TRITON_CACHE_DIR", _CACHE_DIR["dir"])
    try:
        yield
    finally:
        _set_env("TRITON_CACHE_DIR", before)


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
    # attrs has an entry per argument, [] where nothing is specialised
    values, special = _by_name(consts, names), {n for n, v in _by_name(attrs, names).items() if v}
    const = " ".join(f"{n}={values[n]}" for n in names if n in values)
    div = " ".join(n for n in names if n in special)
    return name, const + (f"; 16: {div}" if div else "")


def compile_listener(*, src=None, metadata=None, metadata_group=None, times=None, cache_hit=False, stream=None,
                     **_) -> None:
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


def install_compile_log() -> bool:
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
            comp.listener = _chain(comp.listener, compile_listener)
            _INSTALLED["done"] = True
    return True
