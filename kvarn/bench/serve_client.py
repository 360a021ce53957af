"""Client side of serve mode: stream `/v1/completions` with token-id prompts and time every chunk, the way
`vllm bench serve` does (vllm/benchmarks/lib/endpoint_request_func.py), with its arrival process (Poisson /
gamma `--burstiness`, `--request-rate inf` = all at once) and `--max-concurrency` cap. Standard library only.
"""
from __future__ import annotations

import http.client
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .metrics import RequestRecord


def wait_healthy(host: str, port: int, timeout_s: float, proc=None, poll_s: float = 1.0) -> None:
    """Poll GET /health until 200; raise RuntimeError if `proc` exits first, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before /health answered")
        c = http.client.HTTPConnection(host, port, timeout=5)
        try:
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            c.close()
        time.sleep(poll_s)
    raise TimeoutError(f"server on {host}:{port} not healthy after {timeout_s:.0f} s")


def arrival_delays(n: int, request_rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Send times (s from start) of `n` requests, as `vllm bench serve` draws them (get_request): each request waits
    one gap ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)) after the previous (the first one too), and the
    cumulative times are rescaled so the last one is sent at exactly n / rate; burstiness inf = constant 1/rate."""
    if not request_rate or request_rate == float("inf"):
        return [0.0] * n
    if burstiness == float("inf"):
        gaps = [1.0 / request_rate] * n
    else:
        rng = random.Random(seed)
        theta = 1.0 / (request_rate * burstiness)
        gaps = [rng.gammavariate(burstiness, theta) for _ in range(n)]
    out, t = [], 0.0
    for g in gaps:
        t += g
        out.append(t)
    scale = n / request_rate / out[-1] if out and out[-1] > 0 else 1.0
    return [x * scale for x in out]


def stream_completion(host: str, port: int, payload: dict, timeout_s: float,
                      start: float | None = None) -> RequestRecord:
    """One streamed request; TTFT at the first chunk with choices, ITL for each later one, usage for the count.
    `start`: the perf_counter time the request was due (default now), so a wait for a thread counts in its latency."""
    rec = RequestRecord(prompt_len=len(payload["prompt"]) if isinstance(payload["prompt"], list) else 0)
    st = time.perf_counter() if start is None else start
    rec.start = st
    last = st
    first = False
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        conn.request("POST", "/v1/completions", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}"
            return rec
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line or line.startswith(b":"):
                continue
            chunk = line.decode().removeprefix("data: ").strip()
            if chunk == "[DONE]":
                break
            data = json.loads(chunk)
            if data.get("choices"):
                now = time.perf_counter()
                if not first:
                    first = True
                    rec.ttft = now - st
                else:
                    rec.itl.append(now - last)
                last = now
            elif data.get("usage"):
                rec.output_tokens = int(data["usage"].get("completion_tokens") or 0)
                if data["usage"].get("prompt_tokens") is not None:
                    rec.prompt_len = int(data["usage"]["prompt_tokens"])
        rec.latency = last - st
        rec.success = first
        if not first:
            rec.error = "no chunk with a token was received"
        if rec.success and not rec.output_tokens:
            rec.output_tokens = len(rec.itl) + 1  # no usage chunk: count chunks
    except Exception as e:  # noqa: BLE001 - any transport error is a failed request, as in vllm bench
        rec.error = f"{type(e).__name__}: {e}"
    return rec


class MetricsSampler(threading.Thread):
    """Polls the server's Prometheus /metrics: peak running/waiting requests, peak KV usage, preemptions."""

    _LINE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")

    def __init__(self, host: str, port: int, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.host, self.port, self.interval_s = host, port, interval_s
        self.peak: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._halt = threading.Event()

    def _text(self) -> str:
        c = http.client.HTTPConnection(self.host, self.port, timeout=5)
        try:
            c.request("GET", "/metrics")
            return c.getresponse().read().decode(errors="replace")
        finally:
            c.close()

    def pool(self) -> tuple[int, int] | None:
        """(num_gpu_blocks, block_size) from the server's `vllm:cache_config_info` gauge (its labels are the
        CacheConfig's fields), or None when the server does not say."""
        try:
            return cache_pool(self._text())
        except (OSError, ValueError, http.client.HTTPException):
            return None

    def scrape(self) -> dict[str, float]:
        text = self._text()
        vals: dict[str, float] = {}
        for line in text.splitlines():
            m = self._LINE.match(line.strip())
            if m:
                vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(2))  # sum over label sets
        return vals

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval_s)

    def sample(self) -> None:
        try:
            vals = self.scrape()
        except (OSError, ValueError, http.client.HTTPException):
            return
        self.last = vals
        for k, v in vals.items():
            self.peak[k] = max(self.peak.get(k, v), v)

    def stop(self) -> dict:
        self._halt.set()
        self.join(timeout=10)
        self.sample()
        return {
            "peak_running": self.peak.get("vllm:num_requests_running", float("nan")),
            "peak_waiting": self.peak.get("vllm:num_requests_waiting", float("nan")),
            "kv_usage_peak": self.peak.get("vllm:kv_cache_usage_perc", float("nan")),
            "preemptions": self.last.get("vllm:num_preemptions_total", self.last.get("vllm:num_preemptions", float("nan"))),
        }


_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def cache_pool(metrics_text: str) -> tuple[int, int] | None:
    """(num_gpu_blocks, block_size) from a /metrics page's `vllm:cache_config_info{...}` line, else None."""
    for line in metrics_text.splitlines():
        m = _INFO.match(line.strip())
        if m:
            labels = dict(_LABEL.findall(m.group(1)))
            try:
                blocks, block = int(labels["num_gpu_blocks"]), int(labels["block_size"])
            except (KeyError, ValueError):
                return None
            return (blocks, block) if blocks > 0 and block > 0 else None
    return None


def run_load(host: str, port: int, model: str, prompts: list[list[int]], output_len: int, *,
             request_rate: float | None = None, burstiness: float = 1.0, max_concurrency: int | None = None,
             seed: int = 0, request_timeout_s: float = 3600.0, extra_body: dict | None = None,
             on_done=None) -> tuple[list[RequestRecord], float]:
    """Send every prompt on schedule; return the records (prompt order) and the benchmark duration (s).
    on_done(record), if given, is called as each request ends (from its sending thread)."""
    delays = arrival_delays(len(prompts), request_rate, burstiness, seed)
    gate = threading.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord | None] = [None] * len(prompts)

    def one(i: int, due: float) -> None:
        payload = {"model": model, "prompt": prompts[i], "max_tokens": output_len, "stream": True,
                   "stream_options": {"include_usage": True}, "ignore_eos": True, "repetition_penalty": 1.0}
        payload.update(extra_body or {})
        if gate:
            with gate:  # as vLLM's semaphore: the clock starts once the request may go
                records[i] = stream_completion(host, port, payload, request_timeout_s)
        else:
            records[i] = stream_completion(host, port, payload, request_timeout_s, start=due)
        if on_done is not None:
            on_done(records[i])

    start = time.perf_counter()
    # one thread per request in flight (vLLM's client has no connection cap); past the cap a request waits for a
    # thread, and that wait counts in its TTFT / E2EL (its clock starts when it was due)
    workers = max(1, min(len(prompts), max_concurrency or len(prompts), 4096))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = []
        for i, d in enumerate(delays):
            wait = start + d - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            futures.append(pool.submit(one, i, time.perf_counter()))
        for f in futures:
            f.result()
    duration = time.perf_counter() - start
    return [r for r in records if r is not None], duration
