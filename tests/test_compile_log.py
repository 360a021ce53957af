"""KVARN_LOG_COMPILES: one timed line per Triton compile (kvarn.kernels.compile_log), chained with other hooks."""
import io
import re

import pytest


def _kw(name="_flush_layers_kernel", key=("k", 1), warm=False):
    from types import SimpleNamespace

    fn = SimpleNamespace(name=name, module=None, jit_function=None)
    return dict(key=key, repr=f"{name}[num_warps=8, num_ctas=1](ktab_ptr: *i64, n_tiles: i32)", fn=fn,
                compile={}, is_manual_warmup=warm, already_compiled=False)


def test_compile_line_names_the_kernel_its_duration_and_arguments():
    from kvarn.kernels import compile_log

    out = io.StringIO()
    assert compile_log.on_start(**_kw()) is None  # never skips Triton's compile
    compile_log.on_done(**_kw(), stream=out)
    line = out.getvalue().strip()
    assert re.fullmatch(r"\[kvarn\] \d\d:\d\d:\d\d\.\d{3} triton compile _flush_layers_kernel \d+\.\d\d s "
                        r"\(ktab_ptr: \*i64, n_tiles: i32\)", line), line
    out = io.StringIO()
    compile_log.on_done(**_kw(key=("never", "started"), warm=True), stream=out)  # no start seen: nan, still logged
    assert "nan s (warm-up)" in out.getvalue()


def test_install_chains_hooks_once(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    from kvarn.kernels import compile_log

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append("theirs") or None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setitem(compile_log._INSTALLED, "done", False)
    assert compile_log.install() and compile_log.install()  # the second call changes nothing
    assert knobs.runtime.jit_cache_hook(**_kw()) is None and seen == ["theirs"]
    assert knobs.runtime.jit_post_compile_hook is compile_log.on_done
