import dataclasses

import pytest


@pytest.fixture
def bench_cfg():
    """A bench configuration as the worker's spec carries it (BenchConfig fields as a dict), for a kv dtype."""
    from kvarn.bench.config import BenchConfig

    def make(kv: str = "auto", **kw) -> dict:
        base = dict(model="m", kv_dtype=kv, tp=1, engine="vllm", mode="offline", burst=4096, prompt_len=512,
                    output_len=3584, requests=8, gpu_memory_utilization=0.9, max_num_seqs=None, dummy_weights=True,
                    seed=0)
        base.update(kw)
        return dataclasses.asdict(BenchConfig(**base))

    return make
