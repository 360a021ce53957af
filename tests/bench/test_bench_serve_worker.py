"""Serve mode end to end through the worker: a fake `vllm serve` (the 0.26 surface run_serve uses: the CLI module,
its "GPU KV cache size" log line, /health, streamed /v1/completions with a usage chunk, Prometheus /metrics)."""
import json
import textwrap
from pathlib import Path

import pytest

from kvarn.bench.config import BenchConfig, Cell
from kvarn.bench.engines.vllm_engine import VllmEngine

FAKE_SERVE = '''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
assert argv[0] == "serve", argv
open(os.environ["FAKE_SERVE_ARGV"], "w").write(json.dumps(argv))
host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
served = {"n": 0}
lock = threading.Lock()

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes, as a streamed SSE reply may

    def log_message(self, *a):
        pass

    def _send(self, code, body, ctype="text/plain"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, "")
        if self.path == "/metrics":
            with lock:
                n = served["n"]
            return self._send(200, "# HELP x\\n"
                              f'vllm:num_requests_running{{model_name="m"}} {min(n, 3)}\\n'
                              "vllm:num_requests_waiting 0\\nvllm:kv_cache_usage_perc 0.25\\n"
                              f"vllm:num_preemptions_total {n}\\n"  # one per request served, cumulative
                              + ("" if os.environ.get("FAKE_SERVE_NO_INFO") else
                                 'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="28107"} 1.0\\n'))
        self._send(404, "no")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/completions" and body["stream"] and body["ignore_eos"]
        assert isinstance(body["prompt"], list) and body["stream_options"] == {"include_usage": True}
        with lock:
            served["n"] += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            time.sleep(0.003)
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\\n\\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        self.wfile.write(("data: " + json.dumps({"choices": [], "usage": usage}) + "\\n\\ndata: [DONE]\\n\\n").encode())

if os.environ.get("FAKE_SERVE_OOM"):  # the engine dies while sizing its KV cache; the reason is only in the log
    print("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`", flush=True)
    sys.exit(1)
print("INFO 11-29 12:00:00 [kv_cache_utils.py:2177] GPU KV cache size: 3,513,375 tokens", flush=True)  # 28,107 blocks at 4,000
time.sleep(0.3)  # /health answers only after the engine is up, as vllm serve's does
ThreadingHTTPServer((host, port), H).serve_forever()
'''


@pytest.fixture
def fake_serve(tmp_path, monkeypatch):
    cli = tmp_path / "site" / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for d in (cli.parents[1], cli.parent, cli):
        (d / "__init__.py").write_text("")
    (cli / "main.py").write_text(textwrap.dedent(FAKE_SERVE))
    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}:{root}")
    monkeypatch.setenv("FAKE_SERVE_ARGV", str(tmp_path / "argv.json"))
    return tmp_path


def test_serve_mode_metrics_capacity_warmup_and_goodput(fake_serve, monkeypatch):
    monkeypatch.setenv("KVARN_PROGRESS_S", "0")  # progress.json written at every update
    shape = Path(__file__).resolve().parents[2] / "suites" / "models" / "qwen3-8b.json"
    cfg = BenchConfig(model="Qwen/Qwen3-8B", kv_dtype="kvarn_k4v2_g128", tp=1, engine="vllm", mode="serve",
                      burst=4000, prompt_len=512, output_len=6, requests=4, gpu_memory_utilization=0.9,
                      max_num_seqs=None, dummy_weights=True, seed=0, model_path=str(shape),
                      goodput=json.dumps({"ttft": 60000, "tpot": 60000}))
    cell = Cell(cfg, 0, "run", str(fake_serve / "logs" / f"{cfg.hash}-r0.log"))
    res = VllmEngine().run(cell, timeout_s=120)
    assert res.status == "ok", (res.error, Path(cell.log_path).read_text()[-2000:])
    m = res.metrics
    assert m["completed"] == 4 and m["total_output_tokens"] == 24 and m["total_input_tokens"] == 4 * 512
    assert m["ttft_ms_p50"] > 0 and m["tpot_ms_p50"] > 0 and m["itl_ms_p50"] > 0 and m["e2el_ms_p50"] > 0
    assert m["goodput_req_s"] == pytest.approx(m["request_throughput"])  # generous SLOs: every request meets them
    # capacity from the server's own log line, which vLLM 0.26 prints as int(max concurrency x max_model_len) with
    # max_model_len = the burst (4,000 tokens: not a whole number of 128-token blocks, so 28,107 blocks print as
    # 28,107 / 32 x 4,000 = 3,513,375): the row holds the pool, 28,107 x 128 tokens, and 28,107 / 32 requests
    assert m["kv_tokens"] == 3_597_696 and m["max_concurrency"] == pytest.approx(28_107 / 32)
    monkeypatch.setenv("FAKE_SERVE_NO_INFO", "1")  # no cache-config gauge: the log line, inverted, says the same
    again = VllmEngine().run(cell, timeout_s=120)
    assert again.status == "ok" and again.metrics["kv_tokens"] == 3_597_696
    # the untimed warm-up burst ran first: the fake's cumulative counter (one per request served) minus the warm-up's
    # leaves the timed burst's 4
    assert m["peak_running"] == 3 and m["kv_usage_peak"] == 0.25 and m["preemptions"] == 4
    argv = json.loads((fake_serve / "argv.json").read_text())
    assert argv[argv.index("--kv-cache-dtype") + 1] == "kvarn_k4v2_g128" and "--skip-tokenizer-init" in argv
    assert argv[argv.index("--block-size") + 1] == "128" and argv[argv.index("--load-format") + 1] == "dummy"
    assert "GPU KV cache size" in Path(cell.log_path).read_text()
    # what a timeout would have reported: the burst's requests as they ended (progress.json of the cell's work dir)
    from kvarn.bench.progress import read_progress

    prog = read_progress(Path(cell.log_path).with_suffix(".work"))
    assert prog["phase"] == "burst" and prog["num_requests"] == 4 and prog["kv_tokens"] == 3_597_696
    assert prog["completed"] == 4 and prog["total_output_tokens"] == 24 and prog["engine_start_s"] > 0


def test_serve_start_oom_is_an_oom_row(fake_serve, monkeypatch):
    """A server that dies at start says why only in its log: the row is `oom` with that line, not a bare exit code."""
    monkeypatch.setenv("FAKE_SERVE_OOM", "1")
    shape = Path(__file__).resolve().parents[2] / "suites" / "models" / "qwen3-8b.json"
    cfg = BenchConfig(model="Qwen/Qwen3-8B", kv_dtype="auto", tp=1, engine="vllm", mode="serve", burst=4096,
                      prompt_len=512, output_len=6, requests=4, gpu_memory_utilization=0.9, max_num_seqs=None,
                      dummy_weights=True, seed=0, model_path=str(shape))
    cell = Cell(cfg, 0, "run", str(fake_serve / "logs" / f"{cfg.hash}-r0.log"))
    res = VllmEngine().run(cell, timeout_s=60)
    assert res.status == "oom" and "No available memory for the cache blocks" in res.error, res.error
