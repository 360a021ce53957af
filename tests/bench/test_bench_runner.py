"""kvarn bench orchestration with a fake engine from the registry: plan, dry run, resume, --force, failures,
timeouts (a real process group is killed), Parquet columns, bad input (exit 2, nothing written)."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

from kvarn.bench.engines.base import Engine, EngineResult, register_engine
from kvarn.engines import gpus
from kvarn.engines.launch import Launcher
from kvarn.engines.process import _alive
from kvarn.results import ResultsStore
from kvarn.results.schema import BENCH_METRICS, CORE_COLUMNS
from kvarn_cli.app import main

CALLS: list = []
KV = {"auto": 1000.0, "fp8": 2000.0, "turboquant_4bit_nc": 3500.0, "kvarn_k4v2_g128": 4700.0}


@register_engine("fake")
class FakeEngine(Engine):
    name = "fake"
    modes = ("offline", "serve")
    default_timeout_s = 30.0

    def run(self, cell, timeout_s):
        CALLS.append((cell.config.kv_dtype, cell.repeat))
        Path(cell.log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(cell.log_path).write_text("fake engine log\n")
        if os.environ.get("FAKE_FAIL") == cell.config.kv_dtype:
            raise RuntimeError("engine crashed")  # an engine bug must become a failed row
        if cell.config.kv_dtype == "turboquant_k3v4_nc":
            return EngineResult("failed", "RuntimeError: Triton compile failed")
        tok = 100.0 if cell.config.kv_dtype == "auto" else 80.0
        return EngineResult("ok", "", {"output_tok_s": tok, "total_tok_s": 2 * tok, "kv_tokens": KV[cell.config.kv_dtype],
                                       "engine_start_s": 1.0})


SLEEPER = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
           " open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(60)")


@register_engine("sleepy")
class SleepyEngine(Engine):
    """Runs a worker that spawns a grandchild and sleeps: the timeout must end both."""
    name = "sleepy"

    def run(self, cell, timeout_s):
        pidfile = Path(cell.log_path).with_suffix(".pid")
        res = Launcher().run([sys.executable, "-c", SLEEPER, str(pidfile)], cell.log_path, timeout_s)
        if res.timed_out:
            return EngineResult("timeout", f"no result after {timeout_s:.0f} s", {"wall_s": res.elapsed_s})
        return EngineResult("ok")


def bench(tmp_path, *args, env=None):
    CALLS.clear()
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return main(["bench", "--engine", "fake", "--out", str(tmp_path / "res"), "--burst", "2k", "--requests", "4",
                     *args])
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_dry_run_prints_plan_and_writes_nothing(tmp_path, capsys):
    assert bench(tmp_path, "--dry-run", "--kv-dtype", "fp8,auto", "--repeat", "3", "--burst", "4k,2k") == 0
    text = capsys.readouterr().out
    assert "12 cells" in text and "dry run" in text and "4x(512+3584)" in text and "4x(256+1792)" in text
    assert text.index("auto") < text.index("fp8")  # FP16 runs first so later rows get their ratios
    assert not CALLS and not (tmp_path / "res").exists()


def test_dry_run_plan_fits_80_columns(tmp_path, capsys):
    # the longest dtype name: every column whole in an 80-column terminal (nothing cut to "…")
    assert bench(tmp_path, "--dry-run", "--kv-dtype", "auto,turboquant_k3v4_nc", "--burst", "8192", "--requests", "128",
                 "--prompt-len", "1024", env={"COLUMNS": "80"}) == 0
    text = capsys.readouterr().out
    assert "turboquant_k3v4_nc" in text and "128x(1024+7168)" in text and "8,192" in text and "…" not in text


def test_resume_skips_finished_cells_and_force_redoes_them(tmp_path, capsys):
    kvs = "auto,fp8,turboquant_k3v4_nc"
    assert bench(tmp_path, "--kv-dtype", kvs, "--repeat", "2") == 1  # the fake TurboQuant cells fail
    assert len(CALLS) == 6
    df = ResultsStore(tmp_path / "res").read("bench")
    assert len(df) == 6 and set(df.status) == {"ok", "failed"}
    assert bench(tmp_path, "--kv-dtype", kvs, "--repeat", "2") == 1
    assert CALLS == [("turboquant_k3v4_nc", 0), ("turboquant_k3v4_nc", 1)]  # only the failed cells again
    assert "resuming: 4 of 6" in capsys.readouterr().out
    assert bench(tmp_path, "--kv-dtype", kvs, "--repeat", "2", "--force") == 1
    assert len(CALLS) == 6
    assert bench(tmp_path, "--kv-dtype", "auto,fp8", "--repeat", "2") == 0 and CALLS == []
    assert "already have an ok row" in capsys.readouterr().out


def test_failing_configuration_is_a_row_and_the_rest_still_run(tmp_path, capsys):
    rc = bench(tmp_path, "--kv-dtype", "auto,fp8,kvarn_k4v2_g128,turboquant_k3v4_nc", env={"FAKE_FAIL": "fp8"})
    assert rc == 1  # every cell ran; the exit status says some did not end ok
    df = ResultsStore(tmp_path / "res").read("bench").set_index("kv_dtype")
    assert df.loc["fp8", "status"] == "failed" and "engine crashed" in df.loc["fp8", "error"]
    assert df.loc["turboquant_k3v4_nc", "status"] == "failed" and "Triton" in df.loc["turboquant_k3v4_nc", "error"]
    assert df.loc["kvarn_k4v2_g128", "status"] == "ok"
    # ratios vs the FP16 row of the same run, written with the row
    assert df.loc["kvarn_k4v2_g128", "kv_ratio_vs_fp16"] == pytest.approx(4.7)
    assert df.loc["kvarn_k4v2_g128", "output_tok_s_ratio_vs_fp16"] == pytest.approx(0.8)
    assert df.loc["auto", "kv_ratio_vs_fp16"] == pytest.approx(1.0)
    assert "2 ok, 2 not ok" in capsys.readouterr().out
    # the summary table: medians, ratios vs FP16, the error of failed configurations
    import io

    from rich.console import Console

    from kvarn.bench.view import summary_table

    buf = io.StringIO()
    Console(file=buf, width=300).print(summary_table(ResultsStore(tmp_path / "res").read("bench").to_dict("records")))
    table = buf.getvalue()
    assert "4.70x" in table and "0.80x" in table and "failed: RuntimeError: engine crashed" in table


def test_parquet_schema_columns(tmp_path):
    assert bench(tmp_path, "--kv-dtype", "auto,fp8", "--seed", "7") == 0
    df = ResultsStore(tmp_path / "res").read("bench")
    need = set(CORE_COLUMNS) | set(BENCH_METRICS) | {
        "mode", "burst", "prompt_len", "output_len", "requests", "gpu_memory_utilization", "max_num_seqs",
        "dummy_weights", "model_dtype", "engine_args", "log_path", "wall_s", "started_at"}
    assert need <= set(df.columns), need - set(df.columns)
    r = df.iloc[0]
    assert r.kind == "bench" and r.engine == "fake" and r.seed == 7 and r.burst == 2048 and r.prompt_len == 256
    assert r.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and bool(r.dummy_weights)
    assert Path(r.log_path).name == f"{r.config_hash}-r0.log" and Path(r.log_path).is_file()
    assert df.config_hash.nunique() == 2 and r.schema_version == 1 and r.git_sha is not None
    parts = list((tmp_path / "res" / "parts").glob("*.parquet"))
    assert len(parts) == 2  # one atomic append per finished cell


@pytest.mark.parametrize("args,msg", [
    (["--burst", "16q"], "--burst '16q' is not a token count"),
    (["--kv-dtype", "fp9"], "unknown kv dtype 'fp9'"),
    (["--model", "nobody/NoSuchModel-7B"], "not in the local Hugging Face cache"),
    (["--tp", "3", "--model", "qwen3-8b"], "--tp 3 does not divide"),
    (["--burst", "64k"], "exceeds the 8192-token context"),
    (["--mode", "batch"], "unknown --mode"),
    (["--request-rate", "4"], "apply to --mode serve only"),
    (["--prompt-len", "3000"], "leaves no output tokens"),
    (["--engine", "tensorrt"], "unknown --engine"),
    (["--seed", "-1"], "--seed must be >= 0"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, args, msg):
    assert bench(tmp_path, *args) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1
    assert not (tmp_path / "res").exists() and not CALLS


def test_vllm_engine_checks_visible_gpus_and_fp8_dtype(tmp_path, capsys, monkeypatch):
    from kvarn.bench.engines import vllm_engine

    monkeypatch.setattr(gpus, "vllm_available", lambda: True)
    two = [{"index": "0", "name": "H200", "capability": "9.0"}, {"index": "1", "name": "H200", "capability": "9.0"}]
    monkeypatch.setattr(gpus, "visible_gpus", lambda: two)
    common = ["bench", "--engine", "vllm", "--model", "qwen3-8b", "--out", str(tmp_path / "r"), "--dry-run"]
    assert main([*common, "--tp", "4"]) == 2
    assert "--tp 4 needs 4 GPUs but 2 are visible" in capsys.readouterr().err
    assert main([*common, "--kv-dtype", "fp8", "--dtype", "float16"]) == 2
    assert "'fp8' does not run with model dtype 'float16'" in capsys.readouterr().err
    assert main([*common, "--tp", "1,2", "--kv-dtype", "auto,fp8,kvarn_k4v2_g128"]) == 0
    text = capsys.readouterr().out
    assert "engine: vllm" in text and "bfloat16" in text and "block_size" in text
    # pipeline stages count too; on a Ray cluster the local GPU count is no bound (workers spread over nodes)
    assert main([*common, "--tp", "2", "--engine-arg", "pipeline_parallel_size=2"]) == 2
    assert "--tp 2 x pipeline_parallel_size 2 needs 4 GPUs but 2 are visible" in capsys.readouterr().err
    assert main([*common, "--tp", "8", "--engine-arg", "pipeline_parallel_size=2",
                 "--distributed-executor-backend", "ray"]) == 0
    assert "dry run: nothing was run" in capsys.readouterr().out
    # serve mode: the modules `vllm serve` imports are checked before anything starts (one line, exit 2)
    real_find = vllm_engine.importlib.util.find_spec
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real_find(name, *a))
    monkeypatch.setattr(vllm_engine, "SERVE_MODULES", ("uvicorn",))
    assert main([*common, "--mode", "serve"]) == 2
    err = capsys.readouterr().err
    assert "--mode serve runs `vllm serve`, whose API server imports uvicorn, not installed here" in err
    assert "pip install uvicorn" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", real_find)
    monkeypatch.setattr(gpus, "visible_gpus", lambda: [])
    assert main([*common]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_timeout_becomes_a_row_and_kills_the_process_group(tmp_path, capsys):
    rc = main(["bench", "--engine", "sleepy", "--kv-dtype", "auto", "--burst", "2k", "--timeout", "1.5",
               "--out", str(tmp_path / "res")])
    assert rc == 1
    df = ResultsStore(tmp_path / "res").read("bench")
    assert list(df.status) == ["timeout"] and "no result after" in df.error[0]
    pid = int(Path(df.log_path[0]).with_suffix(".pid").read_text())
    deadline = time.time() + 5
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the worker's child survived the timeout"
    assert "timeout after" in Path(df.log_path[0]).read_text()


def test_interrupt_kills_the_worker_group(tmp_path):
    """SIGTERM to kvarn bench (a CI cancel) ends the cell in flight and its children, writes no row, exits 130."""
    import signal
    import subprocess

    script = (
        "import sys, tests.bench.test_bench_runner\n"  # registers the sleepy engine in this process
        "from kvarn_cli.app import main\n"
        f"sys.exit(main(['bench', '--engine', 'sleepy', '--kv-dtype', 'auto', '--burst', '2k', '--out', r'{tmp_path / 'res'}']))\n")
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    logs = tmp_path / "res" / "logs"
    deadline = time.time() + 30
    while time.time() < deadline and not list(logs.glob("*.pid")):
        time.sleep(0.1)
    pidfile = next(logs.glob("*.pid"))
    while time.time() < deadline and not pidfile.read_text().strip():
        time.sleep(0.05)
    child = int(pidfile.read_text())
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 130
    deadline = time.time() + 5
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    assert not (tmp_path / "res" / "parts").exists()  # nothing written for the interrupted cell


def test_result_settings_key_only_kvarn_cells(tmp_path, monkeypatch):
    """A result-changing setting (KVARN_SINK) makes the KVarN cells new ones; the FP16 / FP8 cells stay the same, so
    an A/B of the setting reuses them (and the ratios vs FP16)."""
    from kvarn import settings
    from kvarn.bench.plan import BenchOptions, build_plan

    monkeypatch.setattr(gpus, "vllm_available", lambda: True)
    monkeypatch.setattr(gpus, "visible_gpus", lambda: [{"index": "0", "name": "H200", "capability": "9.0"}])
    o = BenchOptions(model="qwen3-8b", kv_dtype="auto,fp8,kvarn_k4v2_g128", engine="vllm", out=str(tmp_path / "r"))
    plain = {c.kv_dtype: c for c in build_plan(o).configs}
    monkeypatch.setenv("KVARN_SINK", "0")
    settings.reload()
    knob = {c.kv_dtype: c for c in build_plan(o).configs}
    assert plain["kvarn_k4v2_g128"].backend_env == \
        "KVARN_BALANCE_ITERS=3;KVARN_DEFER_FLUSH=1;KVARN_FULL_GRAPH=1;KVARN_SINK=16"
    assert knob["kvarn_k4v2_g128"].backend_env == \
        "KVARN_BALANCE_ITERS=3;KVARN_DEFER_FLUSH=1;KVARN_FULL_GRAPH=1;KVARN_SINK=0"
    assert knob["kvarn_k4v2_g128"].hash != plain["kvarn_k4v2_g128"].hash
    assert knob["auto"].hash == plain["auto"].hash and knob["fp8"].hash == plain["fp8"].hash


def test_eager_decode_is_a_throughput_cell_of_its_own(tmp_path, monkeypatch):
    """KVARN_FULL_GRAPH=0 leaves the numbers as they are but not the speed: a bench cell of its own (a gate never
    takes a median over eager and graph runs), while an eval cell is shared."""
    from kvarn import settings
    from kvarn.bench.plan import BenchOptions, build_plan

    monkeypatch.setattr(gpus, "vllm_available", lambda: True)
    monkeypatch.setattr(gpus, "visible_gpus", lambda: [{"index": "0", "name": "H200", "capability": "9.0"}])
    o = BenchOptions(model="qwen3-8b", kv_dtype="auto,kvarn_k4v2_g128", engine="vllm", out=str(tmp_path / "r"))
    graph = {c.kv_dtype: c for c in build_plan(o).configs}
    accuracy_graph = settings.result_env()
    monkeypatch.setenv("KVARN_FULL_GRAPH", "0")
    settings.reload()
    eager = {c.kv_dtype: c for c in build_plan(o).configs}
    assert "KVARN_FULL_GRAPH=0" in eager["kvarn_k4v2_g128"].backend_env
    assert eager["kvarn_k4v2_g128"].hash != graph["kvarn_k4v2_g128"].hash
    assert eager["auto"].hash == graph["auto"].hash
    assert settings.result_env() == accuracy_graph


def test_stall_notes_flag_a_gap_every_request_shared():
    """A row whose longest inter-token gap is seconds long against a median of milliseconds (a kernel compiling
    mid-run) gets a note under the summary; ordinary long prefill steps, failed rows, rows without per-token
    times and rows with preemptions (a preempted request's gap spans its wait and recompute) do not."""
    from kvarn.bench.view import stall_notes

    rows = [{"kv_dtype": "kvarn_k4v2_g128", "repeat": 0, "status": "ok", "itl_ms_max": 12_400.0, "itl_ms_p50": 28.0},
            {"kv_dtype": "auto", "repeat": 0, "status": "ok", "itl_ms_max": 900.0, "itl_ms_p50": 30.0},
            {"kv_dtype": "fp8", "repeat": 0, "status": "failed", "itl_ms_max": 9_000.0, "itl_ms_p50": 30.0},
            {"kv_dtype": "turboquant_4bit_nc", "repeat": 1, "status": "ok", "itl_ms_max": float("nan"),
             "itl_ms_p50": float("nan")},
            {"kv_dtype": "turboquant_k3v4_nc", "repeat": 0, "status": "ok", "itl_ms_max": 4_000.0, "itl_ms_p50": 250.0},
            {"kv_dtype": "kvarn_k4v2_g128", "repeat": 1, "status": "ok", "itl_ms_max": 130_663.0, "itl_ms_p50": 54.9,
             "preemptions": 10.0}]
    notes = stall_notes(rows)
    assert len(notes) == 1 and notes[0].startswith("note: kvarn_k4v2_g128 (repeat 0): one inter-token gap took 12.4 s")


def test_summary_shows_the_capacity_a_timed_out_cell_reached():
    """A configuration without an ok row shows the KV capacity and start its timeout row kept (the progress file);
    throughput and the ratios stay empty (nothing to compare)."""
    import io

    from rich.console import Console

    from kvarn.bench.view import summary_table

    common = {"model": "Qwen/Qwen3-32B", "tp": 1, "burst": 16384, "prompt_len": 14336, "output_len": 2048,
              "requests": 96, "engine": "vllm", "mode": "offline", "repeat": 0, "run_id": "r"}
    rows = [{**common, "config_hash": "a", "kv_dtype": "auto", "status": "timeout", "kv_tokens": 257_904.0,
             "max_concurrency": 15.7, "engine_start_s": 131.0, "output_tok_s": float("nan"),
             "error": "no result after 700 s; process group killed (3 processes); reached: 548 s into the burst"},
            {**common, "config_hash": "b", "kv_dtype": "kvarn_k4v2_g128", "status": "ok", "kv_tokens": 1_129_216.0,
             "max_concurrency": 68.9, "engine_start_s": 152.1, "output_tok_s": 518.3}]
    buf = io.StringIO()
    Console(file=buf, width=300).print(summary_table(rows))
    auto = next(line for line in buf.getvalue().splitlines() if " auto " in line)
    assert "257,904" in auto and "131" in auto and "reached: 548 s into the burst" in auto
    assert "4.38x" not in buf.getvalue()  # no ratio against a row that is not ok


def test_a_resumed_candidate_is_never_paired_with_another_runs_fp16(tmp_path, capsys):
    """FP16 measured by one call, the candidate by the next: no ratio (unpaired), never the stored row silently;
    --baseline-run RUN_ID asks for that cross-run ratio by name and the row says so."""
    assert bench(tmp_path, "--kv-dtype", "auto") == 0
    df = ResultsStore(tmp_path / "res").read("bench")
    fp16 = df.iloc[0]
    assert fp16.ratio_scope == "same-run" and fp16.fp16_row_id == fp16.row_id and fp16.fp16_run_id == fp16.run_id
    assert bench(tmp_path, "--kv-dtype", "auto,fp8") == 0 and CALLS == [("fp8", 0)]
    cand = ResultsStore(tmp_path / "res").read("bench").set_index("kv_dtype").loc["fp8"]
    assert cand.ratio_scope == "unpaired" and cand.fp16_row_id == "" and pd_isnan(cand.kv_ratio_vs_fp16)
    assert "unpaired" in capsys.readouterr().out
    assert bench(tmp_path, "--kv-dtype", "fp8", "--force", "--baseline-run", fp16.run_id) == 0
    rows = ResultsStore(tmp_path / "res").read("bench")
    cand = rows[rows.kv_dtype == "fp8"].sort_values("created_at").iloc[-1]
    assert cand.kv_ratio_vs_fp16 == pytest.approx(2.0) and cand.ratio_scope == "cross-run"
    assert (cand.fp16_row_id, cand.fp16_run_id) == (fp16.row_id, fp16.run_id)
    assert "cross-run" in capsys.readouterr().out
    assert bench(tmp_path, "--kv-dtype", "fp8", "--baseline-run", "nosuchrun") == 2
    assert "--baseline-run 'nosuchrun' is not a run in" in capsys.readouterr().err


def pd_isnan(x) -> bool:
    import math

    return x is None or math.isnan(float(x))
