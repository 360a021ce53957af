"""The vllm bench engine (kvarn.bench.engines.vllm_engine, vllm_cell) end to end through its worker process, with a
fake `vllm` package on PYTHONPATH that mimics the 0.26 surface the worker uses (LLM, SamplingParams,
llm_engine.add_request/step, cache_config, get_metrics); the warm-up burst and the capacity a row reports."""
import textwrap
from pathlib import Path

import pytest

from kvarn.bench.config import BenchConfig, Cell
from kvarn.bench.engines.vllm_engine import VllmEngine
from kvarn.engines import gpus
from tests.bench.helpers import vllm_logged_tokens

FAKE_VLLM = '''
import os, sys, time
from types import SimpleNamespace

class SamplingParams:
    def __init__(self, **kw):
        assert kw["ignore_eos"] is True and kw["detokenize"] is False
        self.max_tokens = kw["max_tokens"]
        self.output_kind = "cumulative"

class _Metric:
    def __init__(self, name, value):
        self.name, self.value = name, value

class _Engine:
    def __init__(self, kw):
        self.reqs, self.running_peak = {}, 0
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(num_gpu_blocks=1000, block_size=kw.get("block_size", 16),
                                         kv_cache_size_tokens=1000 * kw.get("block_size", 16)),
            model_config=SimpleNamespace(get_vocab_size=lambda: 50))
    def add_request(self, rid, prompt, params):
        self.delta = params.output_kind == "delta"
        assert all(0 <= t < 50 for t in prompt["prompt_token_ids"])
        # like vLLM 0.26: an internal id with a random suffix is returned, outputs carry the caller's id
        # FAKE_VLLM_HANG: request 0 ends after one token, then the engine hangs (a burst cut by the timeout)
        self.reqs[rid] = [0, 1 if os.environ.get("FAKE_VLLM_HANG") and rid == "0" else params.max_tokens]
        self.steps = 0
        return rid + "-1a2b3c4d"
    def has_unfinished_requests(self):
        return any(n < m for n, m in self.reqs.values())
    def step(self):
        time.sleep(0.002)
        self.steps += 1
        if os.environ.get("FAKE_VLLM_JIT") and self.steps == 2:  # a kernel compiling in the timed burst
            print("(EngineCore pid=1) [kvarn] 05:21:37.048 triton compile _store_tiles_kernel 6.27 s (H=8 G=128)",
                  file=sys.stderr, flush=True)
        if os.environ.get("FAKE_VLLM_HANG") and self.steps > 3:
            time.sleep(600)
        outs = []
        for rid, st in self.reqs.items():
            if st[0] < st[1]:
                st[0] += 1
                ids = [7] if self.delta else list(range(st[0]))
                shown = "lost" if os.environ.get("FAKE_VLLM_LOSE") and rid == "0" else rid
                outs.append(SimpleNamespace(request_id=shown, finished=st[0] == st[1],
                                            outputs=[SimpleNamespace(token_ids=ids)]))
        return outs

class LLM:
    def __init__(self, **kw):
        if os.environ.get("FAKE_VLLM_OOM"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
        open(os.environ["FAKE_VLLM_KWARGS"], "w").write(repr(sorted(kw.items())))
        self.llm_engine = _Engine(kw)
    def generate(self, prompts, params, use_tqdm=True):  # the untimed warm-up burst
        if os.environ.get("FAKE_VLLM_JIT"):  # compiles in the warm-up are what it is for: not counted
            print("(EngineCore pid=1) [kvarn] 05:21:28.754 triton compile _dequant_kernel 1.33 s (H=8)",
                  file=sys.stderr, flush=True)
        with open(os.environ["FAKE_VLLM_KWARGS"] + ".warm", "a") as f:
            f.write(f"{len(prompts)} {len(prompts[0]['prompt_token_ids'])} {params.max_tokens}\\n")
        return []
    def get_metrics(self):
        return [_Metric("vllm:num_requests_running", float(len(self.llm_engine.reqs))),
                _Metric("vllm:num_preemptions", 0)]
'''


@pytest.fixture(params=["delta", "cumulative"])
def fake_vllm(tmp_path, monkeypatch, request):
    # the fake engine holds no GPU: the wait for the memory of the engine before would only ask a real GPU
    monkeypatch.setattr(gpus, "wait_for_free_memory", lambda *a, **k: "")
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    if request.param == "delta":  # vLLM's RequestOutputKind: the worker asks for only new tokens per step
        (pkg / "sampling_params.py").write_text("class RequestOutputKind:\n    DELTA = 'delta'\n")
    root = Path(__file__).resolve().parents[3]
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}:{root}")
    monkeypatch.setenv("FAKE_VLLM_KWARGS", str(tmp_path / "kwargs.txt"))
    return tmp_path


def _cell(tmp_path, kv="kvarn_k4v2_g128"):
    shape = Path(__file__).resolve().parents[3] / "suites" / "models" / "qwen3-8b.json"
    cfg = BenchConfig(model="Qwen/Qwen3-8B", kv_dtype=kv, tp=1, engine="vllm", mode="offline", burst=4096,
                      prompt_len=512, output_len=6, requests=3, gpu_memory_utilization=0.9, max_num_seqs=None,
                      dummy_weights=True, seed=0, model_path=str(shape))
    return Cell(cfg, 0, "run", str(tmp_path / "logs" / f"{cfg.hash}-r0.log"))


def test_worker_offline_metrics_capacity_and_args(fake_vllm):
    res = VllmEngine().run(_cell(fake_vllm), timeout_s=60)
    assert res.status == "ok", res.error
    m = res.metrics
    assert m["completed"] == 3 and m["total_output_tokens"] == 18 and m["output_tok_s"] > 0
    assert m["kv_tokens"] == 128000 and m["max_concurrency"] == pytest.approx(1000 / 32)  # 4096 / 128 blocks each
    assert m["peak_running"] == 3 and m["preemptions"] == 0 and m["tpot_ms_p50"] > 0 and m["itl_ms_p50"] > 0
    kwargs = (fake_vllm / "kwargs.txt").read_text()
    for needle in ("'kv_cache_dtype', 'kvarn_k4v2_g128'", "'block_size', 128", "'load_format', 'dummy'",
                   "'skip_tokenizer_init', True", "'disable_log_stats', False", "'max_model_len', 4096"):
        assert needle in kwargs
    # one untimed warm-up burst (2 requests, full prompt, 8 tokens) before the timed one, not counted in it
    prompt_len = _cell(fake_vllm).config.prompt_len
    assert (fake_vllm / "kwargs.txt.warm").read_text().split() == ["2", str(prompt_len), str(min(8, 6))]
    log = Path(_cell(fake_vllm).log_path).read_text()
    assert "[kvarn] LLM(" in log
    assert not (Path(_cell(fake_vllm).log_path).parent / f"{Path(_cell(fake_vllm).log_path).stem}.work" / "model").exists()


def test_row_counts_the_kernels_that_compiled_during_the_timed_burst(fake_vllm, monkeypatch):
    """The cell's log says what compiled after the worker's burst mark (a stall of every running request): the row
    carries the count, the seconds and the names; a compile in the untimed warm-up is not counted."""
    res = VllmEngine().run(_cell(fake_vllm), timeout_s=60)
    assert res.status == "ok" and res.metrics["jit_compiles"] == 0 and res.info["jit_kernels"] == ""
    monkeypatch.setenv("FAKE_VLLM_JIT", "1")
    res = VllmEngine().run(_cell(fake_vllm), timeout_s=60)
    assert res.status == "ok", res.error
    assert res.metrics["jit_compiles"] == 1 and res.metrics["jit_compile_s"] == pytest.approx(6.27)
    assert res.info["jit_kernels"] == "_store_tiles_kernel 6.3 s"


def test_lost_requests_fail_the_row(fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_LOSE", "1")
    res = VllmEngine().run(_cell(fake_vllm), timeout_s=60)
    assert res.status == "failed" and "only 2 of 3 requests completed" in res.error


def test_worker_oom_becomes_an_oom_row(fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_OOM", "1")
    res = VllmEngine().run(_cell(fake_vllm, "auto"), timeout_s=60)
    assert res.status == "oom" and "CUDA out of memory" in res.error


def test_timeout_row_says_how_far_the_burst_got(fake_vllm, monkeypatch):
    """A cell killed by its timeout still carries vLLM's capacity and the partial counts (progress.json), and its
    error says them: the burst ran longer than that, a bound on the configuration's throughput."""
    monkeypatch.setenv("FAKE_VLLM_HANG", "1")
    monkeypatch.setenv("KVARN_PROGRESS_S", "0")
    res = VllmEngine().run(_cell(fake_vllm), timeout_s=10)
    assert res.status == "timeout", res.error
    assert res.error.startswith("no result after 10 s; process group killed")
    assert "s into the burst, 1 of 3 requests done, 7 of 18 (39%) output tokens" in res.error, res.error
    secs = float(res.error.split("reached: ")[1].split(" s into")[0])
    assert 2 <= secs <= 10  # counted to the kill, not to the progress file's last write (~0 s into the burst)
    m = res.metrics
    assert m["kv_tokens"] == 128000 and m["completed"] == 1 and m["num_requests"] == 3
    # the column keeps its meaning (tokens of finished requests): request 0's one token
    assert m["total_output_tokens"] == 1 and m["engine_start_s"] >= 0 and m["wall_s"] >= 10
    assert "output_tok_s" not in m  # a partial burst gives no throughput figure


def test_warmup_overflows_one_step_and_preemptions_exclude_it():
    from kvarn.bench.engines.vllm_cell import preemption_count, warmup_requests

    assert warmup_requests(64, 16384, 8192) == 2  # each prompt is split already
    assert warmup_requests(64, 1024, 8192) == 9  # 9 x 1024 > 8192: the 9th is split across steps
    assert warmup_requests(4, 1024, 8192) == 4 and warmup_requests(64, 1024, None) == 2
    assert preemption_count({"vllm:num_preemptions_total": 3.0}) == 3.0
    # the last warm-up prompt is cut so that a decode step completes a tile (its store path compiles untimed too)
    from kvarn.bench.engines.vllm_cell import WARMUP_TILE, warmup_burst

    for plen in (14336, 1024, 1000, 300):
        prompts, out = warmup_burst({"requests": 64, "prompt_len": plen, "output_len": 2048, "seed": 0}, 1000, 8192)
        assert out == 8 and all(len(p) == plen for p in prompts[:-1])
        last = len(prompts[-1])
        assert plen - WARMUP_TILE < last <= plen
        assert any((last + j) % WARMUP_TILE == 0 for j in range(1, out))  # decode steps 1..out-1
        assert prompts[-1] != prompts[0][:last]  # its own random ids: no prefix-cache hit
    # the cut must not undo the overflow of one step's budget (continuation chunks): then one prompt more
    for plen in (2740, 4100):
        prompts, _ = warmup_burst({"requests": 64, "prompt_len": plen, "output_len": 8, "seed": 0}, 1000, 8192)
        assert sum(map(len, prompts)) > 8192 and len(prompts[-1]) < plen
    one, _ = warmup_burst({"requests": 1, "prompt_len": 1000, "output_len": 8, "seed": 0}, 1000, 8192)
    assert [len(p) for p in one] == [1000]  # a single prompt keeps the burst's length
    assert preemption_count({}) != preemption_count({})  # nan when vLLM reports none


def test_offline_capacity_is_the_pool_not_vllms_rounded_figure():
    from types import SimpleNamespace

    from kvarn.bench.engines.vllm_cell import _capacity

    cc = SimpleNamespace(num_gpu_blocks=27_346, block_size=128,
                         kv_cache_size_tokens=vllm_logged_tokens(27_346, 2112, 128))
    metrics, info = _capacity(cc, 2112)
    assert metrics["kv_tokens"] == 27_346 * 128 and info == {"kv_block_size": 128}
    assert metrics["max_concurrency"] == pytest.approx(27_346 / 17)
    # no block count: vLLM's figure is all there is
    metrics, _ = _capacity(SimpleNamespace(num_gpu_blocks=None, block_size=None, kv_cache_size_tokens=5000), 2112)
    assert metrics["kv_tokens"] == 5000


def test_serve_capacity_sources_in_order():
    from kvarn.bench.engines.vllm_cell import _serve_capacity
    from kvarn.bench.serve_client import cache_pool

    page = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="49487"} 1.0\n')
    assert cache_pool(page) == (49_487, 16)
    assert cache_pool('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0') is None
    assert cache_pool("vllm:num_requests_running 3") is None
    # the gauge wins; then the log line inverted with the format's block size; then the line as printed
    assert _serve_capacity((49_487, 16), 123, 2112, None) == (791_792.0, pytest.approx(49_487 / 132))
    assert _serve_capacity(None, 3_397_338, 2112, 128)[0] == 3_500_288
    assert _serve_capacity(None, 5000, 2112, None) == (5000.0, pytest.approx(5000 / 2112))
    tokens, conc = _serve_capacity(None, None, 2112, 128)
    assert tokens != tokens and conc != conc  # nothing known: NaN, not 0
