import os

# Kernels run through the Triton interpreter on CPU-only machines (set before triton is imported).
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _settings_read_per_test():
    """A process reads its KVARN_* settings once (kvarn.settings); a test that sets one (monkeypatch.setenv) gets it
    read afresh, and the next test does not inherit it."""
    from kvarn import settings

    settings.reload()
    yield
    settings.reload()


@pytest.fixture(scope="session")
def overflow_model(tmp_path_factory):
    """(model folder, text file): a tiny local Llama whose layer 1 overflows in float16 (its config's dtype) and
    runs in float32, with a few hundred tokens of text."""
    from tests.overflow_model import make_overflow_model

    root = tmp_path_factory.mktemp("ovf")
    text = root / "text.txt"
    text.write_text("It was the best of times, it was the worst of times, it was the age of wisdom. " * 30)
    return make_overflow_model(root / "model"), text


@pytest.fixture
def tiny_llama(tmp_path):
    """A model folder holding only the config.json of tests.helpers.TINY_LLAMA (random weights, built in seconds)."""
    import json

    from tests.helpers import TINY_LLAMA

    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


@pytest.fixture
def fake_bench_engine(monkeypatch):
    """The bench engine `fake` of tests.bench.helpers registered for this test alone: returns that module (its
    bench() runs `kvarn bench --engine fake`, its CALLS lists the cells run)."""
    from kvarn.bench.engines import ENGINES
    from tests.bench import helpers

    monkeypatch.setitem(ENGINES, "fake", helpers.FakeEngine)
    helpers.CALLS.clear()
    return helpers
