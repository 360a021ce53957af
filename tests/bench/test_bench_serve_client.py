"""Serve-mode client against a fake streaming /v1/completions server: timing, usage counts, errors, arrivals."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvarn.bench.metrics import summarize
from kvarn.bench.serve_client import MetricsSampler, arrival_delays, run_load, wait_healthy

FIRST_S, GAP_S = 0.15, 0.05


class FakeVllm(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # stream until close, like a chunked SSE response

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.end_headers()
        elif self.path == "/metrics":
            body = ('vllm:num_requests_running{engine="0"} 3.0\nvllm:num_preemptions_total{engine="0"} 2.0\n'
                    'vllm:kv_cache_usage_perc{engine="0"} 0.25\n').encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if req["max_tokens"] == 99:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad"}')
            return
        assert req["stream"] and req["ignore_eos"] and isinstance(req["prompt"], list)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(FIRST_S)
        for i in range(req["max_tokens"]):
            if i:
                time.sleep(GAP_S)
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": ""}]}).encode() + b"\n\n")
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": req["max_tokens"], "prompt_tokens": len(req["prompt"])}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()


def test_streamed_requests_give_vllm_bench_metrics(server):
    wait_healthy("127.0.0.1", server, timeout_s=5)
    sampler = MetricsSampler("127.0.0.1", server, interval_s=0.05)
    sampler.start()
    prompts = [[5] * 7 for _ in range(3)]
    recs, dur = run_load("127.0.0.1", server, "m", prompts, 4, max_concurrency=2)
    stats = sampler.stop()
    assert all(r.success for r in recs) and [r.output_tokens for r in recs] == [4, 4, 4]
    assert all(r.prompt_len == 7 and len(r.itl) == 3 for r in recs)
    m = summarize(recs, dur, {"ttft": 10_000})
    assert FIRST_S * 1000 * 0.9 < m["ttft_ms_p50"] < FIRST_S * 1000 + 150
    assert GAP_S * 1000 * 0.9 < m["tpot_ms_p50"] < GAP_S * 1000 + 40
    assert dur > 2 * (FIRST_S + 3 * GAP_S) * 0.9  # max concurrency 2: the third request waited
    assert m["goodput_req_s"] == pytest.approx(3 / dur)
    assert stats["peak_running"] == 3.0 and stats["preemptions"] == 2.0 and stats["kv_usage_peak"] == 0.25


def test_failed_request_and_dead_server(server):
    recs, _ = run_load("127.0.0.1", server, "m", [[1, 2]], 99)
    assert not recs[0].success and "HTTP 400" in recs[0].error
    with pytest.raises(TimeoutError):
        wait_healthy("127.0.0.1", 1, timeout_s=0.3, poll_s=0.1)


def test_arrivals():
    assert arrival_delays(3, None, 1.0, 0) == [0.0, 0.0, 0.0]
    d = arrival_delays(2000, 10.0, 1.0, 0)
    # as vllm bench serve: the first request waits one gap too, and the last goes at exactly n / rate
    assert d == sorted(d) and 0 < d[0] < 2.0 and d[-1] == pytest.approx(200.0)
    assert arrival_delays(4, 2.0, float("inf"), 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])  # constant gaps
    bursty = arrival_delays(2000, 10.0, 0.2, 0)
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    smooth = [b - a for a, b in zip(d, d[1:])]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert var(gaps) > 2 * var(smooth)  # burstiness < 1: more variable gaps, same mean rate
    assert arrival_delays(5, 10.0, 1.0, 1) == arrival_delays(5, 10.0, 1.0, 1)
