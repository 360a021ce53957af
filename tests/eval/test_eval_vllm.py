"""The vllm eval engine with vLLM mocked at its boundary (a fake `vllm` package on PYTHONPATH): the subprocess per
kv dtype, LLM kwargs (KVarN block size, chunked-prefill budget), streamed results, prompt-logprob perplexity,
crashes and timeouts as rows."""
from __future__ import annotations

import json
import math
import os
import textwrap
import time

import pytest

from kvarn.engines import gpus
from kvarn.eval import runner as R
from kvarn.eval.engines import VLLMConfig, VLLMEngine
from kvarn.results import ResultsStore
from tests.eval.helpers import FakeTok

FAKE = textwrap.dedent('''
    import json, os, sys, time

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _O:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _Lp:
        def __init__(self, v):
            self.logprob = v

    class LLM:
        def __init__(self, **kw):
            with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
                f.write(json.dumps(kw) + "\\n")
            if kw["kv_cache_dtype"] == "kvarn_k2v2_g128":
                print("torch.OutOfMemoryError: CUDA out of memory", file=sys.stderr)
                sys.exit(1)
            if kw["kv_cache_dtype"] == "kvarn_k4v4_g128":
                time.sleep(60)
            if kw["kv_cache_dtype"] == "kvarn_k4v2_g64":
                # as vLLM can: an engine-core process that inherits stdout and would outlive the worker (here
                # in a session of its own, out of reach of the worker's process group), and a shutdown that
                # aborts at exit
                import atexit, subprocess
                core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                        start_new_session=True)
                with open(os.environ["FAKE_VLLM_LOG"] + ".core", "w") as f:
                    f.write(str(core.pid))
                atexit.register(os.abort)
            self.q = kw["kv_cache_dtype"] != "auto"
            self.max_len = kw.get("max_model_len") or 10 ** 9

        def generate(self, prompts, sps, use_tqdm=False):
            sps = sps if isinstance(sps, list) else [sps] * len(prompts)
            outs = []
            for p, sp in zip(prompts, sps):
                ids = p["prompt_token_ids"]
                if len(ids) + 1 > self.max_len:  # as vLLM: the prompt plus at least one output token must fit
                    raise ValueError(f"The decoder prompt (length {len(ids)}) plus the number of requested output "
                                     f"tokens (at least 1) is longer than the maximum model length of {self.max_len}.")
                if getattr(sp, "prompt_logprobs", None) is not None:
                    lp = -1.5 if self.q else -1.0
                    outs.append(_O(prompt_logprobs=[None] + [{t: _Lp(lp), t + 1: _Lp(-9.0)} for t in ids[1:]],
                                   outputs=[]))
                else:
                    outs.append(_O(outputs=[_O(text=" 1234567.", token_ids=[5, 6, 7], finish_reason="stop")]))
            return outs
''')


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "fakevllm" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    log = tmp_path / "llm.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fakevllm"), root,
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    # the fake engine holds no GPU: the wait for the memory of the engine before would only ask a real GPU
    monkeypatch.setattr(gpus, "wait_for_free_memory", lambda *a, **k: "")
    return log


def _engine(tmp_path, timeout_s=60.0):
    return VLLMEngine(VLLMConfig(model="/models/m", timeout_s=timeout_s, log_dir=str(tmp_path / "logs")), FakeTok())


def test_vllm_ppl_chunked_prefill_and_rows(tmp_path, fake_vllm):
    o = R.EvalOptions(task="ppl", engine="hf", context="64", limit=3, kv_dtypes="kvarn_k4v2_g128",
                      out=str(tmp_path / "res"))
    rows = R.run_eval(o, engine_obj=_engine(tmp_path))
    calls = [json.loads(x) for x in fake_vllm.read_text().splitlines()]
    assert [c["kv_cache_dtype"] for c in calls] == ["auto", "kvarn_k4v2_g128"]
    k = calls[1]
    assert k["block_size"] == 128 and k["max_num_batched_tokens"] == 128 and k["enable_chunked_prefill"]
    assert k["max_num_seqs"] == 1 and k["max_model_len"] == 65  # the window + the one token vLLM generates
    b, q = rows
    assert b["ppl"] == pytest.approx(math.e) and q["ppl"] == pytest.approx(math.exp(1.5))
    assert q["n"] == 3 and q["delta_vs_fp16"] == pytest.approx(math.exp(1.5) - math.e)


def test_vllm_generate_stream_and_failures(tmp_path, fake_vllm):
    o = R.EvalOptions(task="niah", engine="hf", context="300", limit=2,
                      kv_dtypes="kvarn_k4v2_g128,kvarn_k2v2_g128", out=str(tmp_path / "res"))
    rows = R.run_eval(o, engine_obj=_engine(tmp_path))
    by = {r["kv_dtype"]: r for r in rows}
    assert by["auto"]["status"] == "ok" and by["auto"]["n"] == 2 and by["auto"]["mean_gen_tokens"] == 3
    assert by["kvarn_k2v2_g128"]["status"] == "oom" and "out of memory" in by["kvarn_k2v2_g128"]["error"]
    calls = [json.loads(x) for x in fake_vllm.read_text().splitlines()]
    assert calls[0]["max_model_len"] >= 300 and calls[0]["max_num_batched_tokens"] == 512  # niah: 512-token chunks
    assert calls[0]["max_num_seqs"] <= calls[0]["max_num_batched_tokens"]
    s = ResultsStore(tmp_path / "res").read("sample")
    assert len(s) == 4 and set(s["finish_reason"]) == {"stop"}


def test_vllm_timeout_is_a_row(tmp_path, fake_vllm):
    o = R.EvalOptions(task="ppl", engine="hf", context="64", limit=1, kv_dtypes="kvarn_k4v4_g128",
                      out=str(tmp_path / "res"))
    rows = R.run_eval(o, engine_obj=_engine(tmp_path, timeout_s=4))
    assert [r["status"] for r in rows] == ["ok", "timeout"]


def test_vllm_finished_job_is_ok_whatever_its_engine_core_does_after(tmp_path, fake_vllm):
    o = R.EvalOptions(task="ppl", engine="hf", context="64", limit=2, kv_dtypes="kvarn_k4v2_g64",
                      out=str(tmp_path / "res"))
    t0 = time.monotonic()
    rows = R.run_eval(o, engine_obj=_engine(tmp_path, timeout_s=20))
    assert [(r["status"], r["n"]) for r in rows] == [("ok", 2), ("ok", 2)]
    assert time.monotonic() - t0 < 15  # not held until the time limit by the child that keeps the pipe open
    core = int(open(str(fake_vllm) + ".core").read())
    with pytest.raises(ProcessLookupError):  # ended with its worker: an engine core left running keeps GPU memory
        os.kill(core, 0)


def test_vllm_crash_row_names_the_exception(tmp_path, fake_vllm):
    eng = _engine(tmp_path)
    eng.cfg.max_model_len = 32  # too short for the 64-token windows: the fake raises vLLM's ValueError
    o = R.EvalOptions(task="ppl", engine="hf", context="64", limit=1, kv_dtypes="kvarn_k4v2_g128",
                      out=str(tmp_path / "res"))
    rows = R.run_eval(o, engine_obj=eng)
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert "ValueError: The decoder prompt (length 64)" in rows[0]["error"]


def test_vllm_ppl_window_at_the_model_limit_is_a_clear_error(tmp_path, fake_vllm, monkeypatch):
    from kvarn.errors import KvarnError

    monkeypatch.setattr(R, "_model_max_len", lambda src: 64)
    o = R.EvalOptions(task="ppl", engine="hf", context="64", limit=1, kv_dtypes="kvarn_k4v2_g128",
                      out=str(tmp_path / "res"))
    with pytest.raises(KvarnError, match="use --context 63 or less"):
        R.run_eval(o, engine_obj=_engine(tmp_path))
    assert not fake_vllm.exists()  # no engine was started


def test_model_args_reach_vllm_and_the_config_hash(tmp_path, monkeypatch):
    """--model-args (lm-eval's k=v syntax) are vllm.LLM arguments on the built-in harness too, and part of the
    protocol: a run with prefix caching off does not resume one with it on."""
    import kvarn.eval.engines as E

    monkeypatch.setattr(R, "pick_engine", lambda e: ("vllm", "test"))
    monkeypatch.setattr(E, "load_tokenizer", lambda src: FakeTok())
    o = R.EvalOptions(task="gsm8k", model="/models/m", out=str(tmp_path), kv_dtypes="kvarn_k4v2_g128",
                      model_args="enable_prefix_caching=false,max_num_seqs=1")
    p = R.plan(o)
    assert p.engine_args == {"enable_prefix_caching": False, "max_num_seqs": 1}
    assert json.loads(p.protocol["engine_args"]) == p.engine_args
    assert "engine_args" not in R.plan(R.EvalOptions(task="gsm8k", model="/models/m")).protocol  # old hashes stay
    eng = R._make_engine(p, o)
    a = eng._llm_args(p.formats[1], None, None)
    assert a["enable_prefix_caching"] is False and a["max_num_seqs"] == 1 and a["block_size"] == 128


def test_model_args_refused_on_the_hf_engine(tmp_path):
    from tests.helpers import run_cli

    r = run_cli("eval", "gsm8k", "--engine", "hf", "--model-args", "max_num_seqs=1", "--out", str(tmp_path))
    assert r.returncode == 2 and "--model-args are vLLM engine arguments" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr


def test_engines_side_by_side_share_memory_and_size_their_cache(monkeypatch):
    """--concurrency: each engine takes 1/n of the memory fraction and a KV cache sized up front (vLLM's profiling
    reads the whole GPU, which the other engines change)."""
    from kvarn.engines import gpus
    from kvarn.eval import engines as E
    from kvarn.formats import get_format

    monkeypatch.setattr(gpus, "gpu_total_bytes", lambda: 100 * 2**30)
    fmt = get_format("kvarn_k4v2_g128")
    one = E.VLLMEngine(E.VLLMConfig(model="m"), None)._llm_args(fmt, None, None)
    assert one["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in one
    four = E.VLLMEngine(E.VLLMConfig(model="m", share=4, extra={"gpu_memory_utilization": 0.8}), None)
    a = four._llm_args(fmt, None, None)
    assert a["gpu_memory_utilization"] == 0.2 and a["kv_cache_memory_bytes"] == 10 * 2**30
    assert a["block_size"] == 128
