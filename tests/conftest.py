import os

# Kernels run through the Triton interpreter on CPU-only machines (set before triton is imported).
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

    # The shipped store kernel ("fused" balancing) takes ~50 s per D=128 tile store in the interpreter against ~1 s
    # for "log": CPU runs default to "log" (the same contract, checked by every store test), and
    # tests/test_kernels_store_variants.py runs "fused" itself; on a GPU the tests check the shipped default.
    os.environ.setdefault("KVARN_STORE_BALANCE", "log")
