"""KVARN_LOG_COMPILES: one timed line per Triton compile (kvarn.kernels.runtime), chained with other listeners."""
import io
import re
from types import SimpleNamespace

import pytest


def _kw(cache_hit=False):
    src = SimpleNamespace(name="_flush_layers_kernel", signature={"ktab_ptr": "*i64", "n_tiles": "i32"})
    return dict(src=src, metadata={}, metadata_group={}, times=SimpleNamespace(total=2_410_000), cache_hit=cache_hit)


def test_compile_line_names_the_kernel_its_duration_and_arguments():
    from kvarn.kernels import runtime

    out = io.StringIO()
    runtime.compile_listener(**_kw(), stream=out)
    line = out.getvalue().strip()
    assert re.fullmatch(r"\[kvarn\] \d\d:\d\d:\d\d\.\d{3} triton compile _flush_layers_kernel 2\.41 s "
                        r"\(ktab_ptr: \*i64, n_tiles: i32\)", line), line
    out = io.StringIO()
    runtime.compile_listener(**_kw(cache_hit=True), stream=out)
    assert "2.41 s, disk cache (" in out.getvalue()
    runtime.compile_listener(src=None, metadata=None, metadata_group=None, times=None, cache_hit=False,
                         stream=io.StringIO())  # odd arguments: a line with what is known, never an exception


def test_compile_line_tells_variants_apart():
    """Two variants of one kernel (a row count of 1 made constexpr, a divisible stride) print different lines: the
    constexpr values, then the arguments specialised as divisible by 16 (Triton's ASTSource fields)."""
    from kvarn.kernels import runtime

    sig = {"k_ptr": "*bf16", "stride_kt": "i32", "n_rows": "i32", "H": "constexpr", "DECODE": "constexpr"}
    lines = []
    for n_rows_const, div in ((False, [0, 1]), (True, [0])):
        consts = {(3,): 8, (4,): False}
        if n_rows_const:
            consts[(2,)] = 1
        # as Triton 3.6 builds it: an entry per argument, [] where nothing is specialised
        src = SimpleNamespace(name="_store_tiles_kernel", signature=sig, constants=consts,
                              attrs={(i,): [["tt.divisibility", 16]] if i in div else [] for i in range(3)})
        out = io.StringIO()
        runtime.compile_listener(src=src, times=SimpleNamespace(total=4_780_000), stream=out)
        lines.append(out.getvalue().strip())
    assert lines[0].endswith("_store_tiles_kernel 4.78 s (H=8 DECODE=False; 16: k_ptr stride_kt)"), lines[0]
    assert lines[1].endswith("_store_tiles_kernel 4.78 s (n_rows=1 H=8 DECODE=False; 16: k_ptr)"), lines[1]


def test_install_chains_listeners_once(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    from kvarn.kernels import runtime

    seen = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: seen.append(kw["cache_hit"]))
    monkeypatch.setitem(runtime._INSTALLED, "done", False)
    assert runtime.install_compile_log() and runtime.install_compile_log()  # the second call changes nothing
    knobs.compilation.listener(**_kw())
    assert seen == [False]  # theirs ran once, ours printed (stderr)
