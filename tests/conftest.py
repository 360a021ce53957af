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
