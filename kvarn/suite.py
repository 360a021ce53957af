"""Declarative suites: one YAML lists models, formats, TP sizes, bursts, eval tasks and repeats; `kvarn suite run`
expands the Cartesian product into `kvarn bench` / `kvarn eval` invocations (one subprocess per cell group: a
crashed engine cannot take the rest of the suite down) that all write into one results directory.

Groups: bench = one per (model, TP, workload) running every format x repeat, a workload being a burst (with the
suite's output_len / requests) or an entry of bench.workloads ({burst, output_len, requests}: e.g. a reasoning-style
burst and a decode-heavy one side by side; optional per entry: `mode`, throughput or serve (default bench.mode),
`models`, the names of the suite's models it runs on (default: all), `formats`, the suite's formats it runs
(default: all; e.g. a slow rival only where it fits), and `args`, bench flags of its own, passed after bench.args);
eval = one per (model, TP, task)
running every format. A model with `weights: dummy` benchmarks with --dummy-weights (real shapes, random weights)
and has no eval steps.
Resuming is the default: each command skips cells whose config hash and repeat are done (`suite run --force`
hands bench --force and eval --no-resume, which redo them).
`bench.pair_fp16: true` hands each bench step `--pair-fp16`: the candidates run after an FP16 cell of the same
`kvarn bench` run on the same GPU, and a resumed step reruns that FP16 cell with the candidates still to do rather
than pairing them with an earlier call's (suites/readme.yaml).
The exact flags each command receives are in BENCH_FLAGS / EVAL_FLAGS; `suite run` checks them against the
command's `--help` before starting, so a CLI mismatch is one clear line, not a failure an hour in.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import KvarnError, choices
from .formats import get_format
from .paths import suites_dir
from .shapes import resolve_model

TOP_KEYS = {"name", "description", "results", "models", "formats", "tp", "bench", "eval", "gate"}
MODEL_KEYS = {"name", "weights", "tp", "dtype"}
BENCH_KEYS = {"mode", "bursts", "output_len", "requests", "repeats", "timeout_min", "args", "workloads", "pair_fp16"}
WORKLOAD_KEYS = {"burst", "output_len", "requests", "mode", "models", "formats", "args"}
EVAL_KEYS = {"tasks", "samples", "limit", "timeout_min", "args"}
TASK_KEYS = {"name", "samples", "limit", "context", "args"}
GATE_KEYS = {"baseline", "policy"}
MODES = ("throughput", "serve")

# How a suite field becomes a flag of `kvarn bench` / `kvarn eval` (one place to adapt if their CLIs change).
BENCH_FLAGS = {"model": "--model", "weights": "--weights", "kv_dtype": "--kv-dtype", "tp": "--tp", "mode": "--mode",
               "burst": "--burst", "output_len": "--output-len", "requests": "--requests", "repeats": "--repeats",
               "out": "--out", "dummy": "--dummy-weights", "pair_fp16": "--pair-fp16"}
# (bench always resumes finished cells, --force redoes them: no resume flag to pass)
BENCH_FORCE, EVAL_NO_RESUME = "--force", "--no-resume"
EVAL_FLAGS = {"model": "--model", "weights": "--weights", "kv_dtype": "--kv-dtype", "tp": "--tp", "task": "--task",
              "samples": "--samples", "limit": "--limit", "context": "--context", "out": "--out", "resume": "--resume"}


@dataclass
class Step:
    kind: str  # bench | eval
    title: str
    argv: list[str]  # arguments after `kvarn`
    cells: int
    runs: int
    timeout_s: float | None = None

    def command(self) -> str:
        return "kvarn " + " ".join(shlex.quote(a) for a in self.argv)


@dataclass
class Suite:
    name: str
    path: Path
    description: str
    results: str
    models: list[dict]
    formats: list[str]
    tp: list[int]
    bench: dict | None
    eval: dict | None
    gate: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)

    def bench_cells(self) -> int:
        if not self.bench:
            return 0
        return sum(len(m["tp"]) * len(w.get("formats", self.formats))
                   for m in self.models for w in self.bench["workloads"] if runs_on(w, m))

    def eval_cells(self) -> int:
        if not self.eval:
            return 0
        return (sum(len(m["tp"]) for m in self.models if m["weights"] != "dummy") * len(self.formats)
                * len(self.eval["tasks"]))


def runs_on(workload: dict, model: dict) -> bool:
    """Whether a bench workload runs on a model of the suite (its `models` list, default: every model)."""
    return "models" not in workload or model["name"] in workload["models"]


# ---- loading & validation -------------------------------------------------------------------------------------------
def find_suite(spec: str | Path) -> Path:
    p = Path(spec)
    if p.is_file():
        return p
    for cand in (suites_dir() / f"{spec}.yaml", suites_dir() / f"{spec}.yml", suites_dir() / str(spec)):
        if cand.is_file():
            return cand
    raise KvarnError(f"suite {str(spec)!r} not found; give a YAML path or one of: {choices(suite_names()) or 'none'}")


def suite_names() -> list[str]:
    out = []
    for p in sorted(suites_dir().glob("*.y*ml")):
        try:
            data = yaml.safe_load(p.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and "models" in data:
            out.append(p.stem)
    return out


def _check_keys(obj, allowed: set, where: str) -> None:
    if not isinstance(obj, dict):
        raise KvarnError(f"{where}: expected a mapping with keys {choices(sorted(allowed))}")
    bad = sorted(set(obj) - allowed)
    if bad:
        raise KvarnError(f"{where}: unknown key {bad[0]!r}; accepted: {choices(sorted(allowed))}")


def _subset(value, where: str, singular: str, accepted: list[str], canon=str) -> list[str]:
    """A workload's own list of the suite's models or formats: one name or a non-empty list, each one of `accepted`
    once `canon` maps both sides (formats: aliases and any casing). Returned in the suite's order and spelling."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise KvarnError(f"{where} must be a non-empty list of this suite's {singular}s ({choices(accepted)}), "
                         f"got {value!r}")
    known = {canon(a): a for a in accepted}
    picked = set()
    for x in items:
        try:
            name = canon(str(x))
        except KvarnError:
            name = None
        if name not in known:
            raise KvarnError(f"{where}: {str(x)!r} is not a {singular} of this suite; accepted: {choices(accepted)}")
        picked.add(name)
    return [a for a in accepted if canon(a) in picked]


def _check_pairable(fmts: list[str], subject: str) -> None:
    """bench.pair_fp16 runs the candidates after an FP16 cell: exactly one FP16 format and at least one other."""
    if sum(get_format(x).family == "fp16" for x in fmts) != 1 or len(fmts) < 2:
        raise KvarnError(f"{subject} pairs candidates with the FP16 cell (bench.pair_fp16): it needs exactly one FP16 "
                         f"format (auto) and at least one other, got {choices(fmts)}")


def _int_list(v, where: str, minimum: int = 1) -> list[int]:
    vals = v if isinstance(v, list) else [v]
    if not vals:
        raise KvarnError(f"{where}: must not be empty")
    out = []
    for x in vals:
        if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
            raise KvarnError(f"{where}: expected integers >= {minimum}, got {x!r}")
        out.append(x)
    return out


def _pos_int(v, where: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise KvarnError(f"{where}: expected one integer >= {minimum}, got {v!r}")
    return v


def load_suite(spec: str | Path) -> Suite:
    path = find_suite(spec)
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise KvarnError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    return validate_suite(data, path)


def validate_suite(data, path: Path | str = "suite") -> Suite:
    where = str(path)
    _check_keys(data, TOP_KEYS, where)
    for req in ("models", "formats"):
        if req not in data:
            raise KvarnError(f"{where}: missing required key {req!r}")
    if "bench" not in data and "eval" not in data:
        raise KvarnError(f"{where}: nothing to run; give a bench and/or an eval section")
    name = str(data.get("name") or Path(path).stem)
    default_tp = _int_list(data.get("tp", [1]), f"{where}: tp")

    formats = data["formats"]
    if not isinstance(formats, list) or not formats:
        raise KvarnError(f"{where}: formats must be a non-empty list of kv dtypes")
    fmts: list[str] = []
    for f in formats:
        try:
            name_ = get_format(str(f)).name
        except KvarnError as e:
            raise KvarnError(f"{where}: formats: {e}") from None
        if name_ not in fmts:
            fmts.append(name_)

    models_raw = data["models"]
    if not isinstance(models_raw, list) or not models_raw:
        raise KvarnError(f"{where}: models must be a non-empty list")
    models = []
    for i, m in enumerate(models_raw):
        m = {"name": m} if isinstance(m, str) else m
        _check_keys(m, MODEL_KEYS, f"{where}: models[{i}]")
        if "name" not in m:
            raise KvarnError(f"{where}: models[{i}] needs a name (bundled shape, local folder or hub id)")
        try:
            shape = resolve_model(str(m["name"]))
        except KvarnError as e:
            raise KvarnError(f"{where}: models[{i}]: {e}") from None
        tps = _int_list(m.get("tp", default_tp), f"{where}: models[{i}].tp")
        for t in tps:
            try:
                shape.check_tp(t)
            except KvarnError as e:
                raise KvarnError(f"{where}: models[{i}] ({m['name']}): {e}") from None
        weights = m.get("weights")
        if weights is not None and not isinstance(weights, str):
            raise KvarnError(f"{where}: models[{i}].weights must be 'dummy', a local folder or a hub id")
        models.append({"name": str(m["name"]), "shape": shape.name, "weights": weights, "tp": tps,
                       "dtype": m.get("dtype")})

    bench = None
    if data.get("bench") is not None:
        b = data["bench"]
        _check_keys(b, BENCH_KEYS, f"{where}: bench")
        mode = b.get("mode", "throughput")
        if mode not in MODES:
            raise KvarnError(f"{where}: bench.mode must be one of {choices(MODES)}, got {mode!r}")
        bench = {"mode": mode, "bursts": _int_list(b.get("bursts", [16384]), f"{where}: bench.bursts"),
                 "output_len": _pos_int(b.get("output_len", 256), f"{where}: bench.output_len"),
                 "requests": _pos_int(b.get("requests", 64), f"{where}: bench.requests"),
                 "repeats": _pos_int(b.get("repeats", 3), f"{where}: bench.repeats"),
                 "timeout_min": b.get("timeout_min"), "args": [str(a) for a in b.get("args", []) or []],
                 "pair_fp16": b.get("pair_fp16", False)}
        if not isinstance(bench["pair_fp16"], bool):
            raise KvarnError(f"{where}: bench.pair_fp16 must be true or false, got {bench['pair_fp16']!r}")
        if bench["pair_fp16"]:
            _check_pairable(fmts, f"{where}: formats")
        if b.get("workloads") is not None:  # explicit (burst, output_len, requests) triples instead of bursts
            raw = b["workloads"]
            if not isinstance(raw, list) or not raw:
                raise KvarnError(f"{where}: bench.workloads must be a non-empty list of "
                                 "{burst, output_len, requests}")
            bench["workloads"] = []
            names = [m["name"] for m in models]  # what a workload's `models` may name
            for i, w in enumerate(raw):
                if not isinstance(w, dict) or "burst" not in w:
                    raise KvarnError(f"{where}: bench.workloads[{i}] needs a burst "
                                     "(and optionally output_len, requests)")
                _check_keys(w, WORKLOAD_KEYS, f"{where}: bench.workloads[{i}]")
                only = w.get("models")
                if only is not None:
                    only = _subset(only, f"{where}: bench.workloads[{i}].models", "model", names)
                wfmts = w.get("formats")
                if wfmts is not None:
                    wfmts = _subset(wfmts, f"{where}: bench.workloads[{i}].formats", "format", fmts,
                                    lambda x: get_format(x).name)
                    if bench["pair_fp16"]:
                        _check_pairable(wfmts, f"{where}: bench.workloads[{i}].formats")
                wmode = w.get("mode", bench["mode"])
                if wmode not in MODES:
                    raise KvarnError(f"{where}: bench.workloads[{i}].mode must be one of {choices(MODES)}, "
                                     f"got {wmode!r}")
                wargs = w.get("args", []) or []
                if not isinstance(wargs, list):
                    raise KvarnError(f"{where}: bench.workloads[{i}].args must be a list of flags, got {wargs!r}")
                bench["workloads"].append({
                    "burst": _pos_int(w["burst"], f"{where}: bench.workloads[{i}].burst"),
                    "output_len": _pos_int(w.get("output_len", bench["output_len"]),
                                           f"{where}: bench.workloads[{i}].output_len"),
                    "requests": _pos_int(w.get("requests", bench["requests"]),
                                         f"{where}: bench.workloads[{i}].requests"),
                    "mode": wmode,
                    **({"models": only} if only is not None else {}),
                    **({"formats": wfmts} if wfmts is not None else {}),
                    **({"args": [str(a) for a in wargs]} if wargs else {})})
            bench["bursts"] = [w["burst"] for w in bench["workloads"]]
        else:
            bench["workloads"] = [{"burst": x, "output_len": bench["output_len"], "requests": bench["requests"],
                                   "mode": bench["mode"]} for x in bench["bursts"]]
        for m in models:
            ctx = resolve_model(m["name"]).max_context
            for w in bench["workloads"]:  # a burst is the whole context per request (prompt + output), as in bench
                if not runs_on(w, m):
                    continue
                if w["burst"] > ctx:
                    raise KvarnError(f"{where}: bench burst {w['burst']} exceeds {m['name']}'s context of {ctx} tokens")
                if w["output_len"] >= w["burst"]:
                    raise KvarnError(f"{where}: bench output_len {w['output_len']} leaves no prompt in burst "
                                     f"{w['burst']}")
    ev = None
    if data.get("eval") is not None:
        e = data["eval"]
        _check_keys(e, EVAL_KEYS, f"{where}: eval")
        tasks_raw = e.get("tasks")
        if not isinstance(tasks_raw, list) or not tasks_raw:
            raise KvarnError(f"{where}: eval.tasks must be a non-empty list")
        from .eval.tasks import TASKS

        tasks = []
        for i, t in enumerate(tasks_raw):
            t = {"name": t} if isinstance(t, str) else t
            _check_keys(t, TASK_KEYS, f"{where}: eval.tasks[{i}]")
            if "name" not in t:
                raise KvarnError(f"{where}: eval.tasks[{i}] needs a name")
            if str(t["name"]) not in TASKS:
                raise KvarnError(f"{where}: eval.tasks[{i}]: unknown task {t['name']!r}; accepted: {choices(TASKS)}")
            task = {"name": str(t["name"]), "args": [str(a) for a in t.get("args", []) or []]}
            for k in ("samples", "limit", "context"):
                v = t.get(k, e.get(k) if k != "context" else None)
                if v is not None:
                    task[k] = _pos_int(v, f"{where}: eval.tasks[{i}].{k}")
            tasks.append(task)
        ev = {"tasks": tasks, "timeout_min": e.get("timeout_min"), "args": [str(a) for a in e.get("args", []) or []]}
    gate = data.get("gate") or {}
    _check_keys(gate, GATE_KEYS, f"{where}: gate")
    for sect in (bench, ev):
        if sect and sect.get("timeout_min") is not None:
            t = sect["timeout_min"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
                raise KvarnError(f"{where}: timeout_min must be a positive number of minutes, got {t!r}")
    return Suite(name, Path(path), str(data.get("description", "")), str(data.get("results") or f"results/{name}"),
                 models, fmts, default_tp, bench, ev, gate, data)


# ---- planning -------------------------------------------------------------------------------------------------------
def plan(suite: Suite, out: str | Path | None = None, *, resume: bool = True, only: str | None = None) -> list[Step]:
    """The suite's steps. resume (the default): bench and eval skip cells already done; False: they redo them."""
    out = str(out or suite.results)
    steps: list[Step] = []
    kvs = ",".join(suite.formats)
    for m in suite.models:
        for tp in m["tp"]:
            if suite.bench and only in (None, "bench"):
                b = suite.bench
                for w in b["workloads"]:
                    if not runs_on(w, m):
                        continue
                    f = BENCH_FLAGS
                    argv = ["bench", f["model"], m["name"]]
                    if m["weights"] == "dummy":
                        argv.append(f["dummy"])
                    elif m["weights"]:
                        argv += [f["weights"], m["weights"]]
                    common = [f["tp"], str(tp), f["mode"], w["mode"], f["burst"], str(w["burst"]),
                              f["output_len"], str(w["output_len"]), f["requests"], str(w["requests"]),
                              f["repeats"], str(b["repeats"]), f["out"], out]
                    if not resume:
                        common.append(BENCH_FORCE)
                    title = f"bench {m['name']} TP={tp} burst {w['burst']}" + (" serve" if w["mode"] == "serve" else "")
                    if "workloads" in (suite.raw.get("bench") or {}):
                        title += f" ({w['requests']} x {w['burst'] - w['output_len']}+{w['output_len']})"
                    timeout = b["timeout_min"] * 60 if b["timeout_min"] else None
                    fmts = w.get("formats", suite.formats)
                    argv += [f["kv_dtype"], ",".join(fmts), *common]
                    if b.get("pair_fp16"):  # the candidates after an FP16 cell of the same run, also when resumed
                        argv.append(f["pair_fp16"])
                    argv += b["args"] + w.get("args", [])  # the workload's own flags last: they win
                    steps.append(Step("bench", title, argv, len(fmts), len(fmts) * b["repeats"], timeout))
            if suite.eval and only in (None, "eval") and m["weights"] != "dummy":
                e = suite.eval
                for t in e["tasks"]:
                    f = EVAL_FLAGS
                    argv = ["eval", f["model"], m["name"]]
                    if m["weights"]:
                        argv += [f["weights"], m["weights"]]
                    argv += [f["task"], t["name"], f["kv_dtype"], kvs, f["tp"], str(tp)]
                    for k in ("samples", "limit", "context"):
                        if k in t:
                            argv += [f[k], str(t[k])]
                    argv += [f["out"], out]
                    argv.append(f["resume"] if resume else EVAL_NO_RESUME)
                    argv += e["args"] + t["args"]
                    steps.append(Step("eval", f"eval {t['name']} {m['name']} TP={tp}", argv, len(suite.formats),
                                      len(suite.formats), e["timeout_min"] * 60 if e["timeout_min"] else None))
    return steps


# ---- running --------------------------------------------------------------------------------------------------------
def _help_text(cmd: str, runner: list[str]) -> str:
    try:
        r = subprocess.run(runner + [cmd, "--help"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "250"})
    except (OSError, subprocess.SubprocessError) as e:
        raise KvarnError(f"cannot run `kvarn {cmd} --help`: {e}") from None
    return r.stdout + r.stderr if r.returncode == 0 else ""


def preflight(steps: list[Step], runner: list[str]) -> None:
    """Every flag the plan passes must appear in the command's --help (one clear line otherwise)."""
    for kind in sorted({s.kind for s in steps}):
        text = _help_text(kind, runner)
        if not text:
            raise KvarnError(f"`kvarn {kind}` is not available yet (its --help failed); the suite needs it")
        used = {a for s in steps if s.kind == kind for a in s.argv if a.startswith("--")}
        missing = sorted(a for a in used if a not in text)
        if missing:
            raise KvarnError(f"`kvarn {kind}` does not accept {', '.join(missing)} (see `kvarn {kind} --help`); "
                             f"adapt the suite or kvarn/suite.py {kind.upper()}_FLAGS")


def run_suite(suite: Suite, steps: list[Step], out: str | Path, *, fail_fast: bool = False,
              runner: list[str] | None = None, check_flags: bool = True, echo=print) -> dict:
    """Run the steps one after another; record each exit code, duration and log. Returns the manifest."""
    runner = runner or [sys.executable, "-m", "kvarn_cli.app"]
    out = Path(out)
    if check_flags:
        preflight(steps, runner)
    logs = out / "suite-logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvarnError(f"cannot create {logs}: {e}") from None
    text = suite.path.read_text() if suite.path.is_file() else yaml.safe_dump(suite.raw)
    suite_id = f"{suite.name}-{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    manifest = {"suite": suite.name, "suite_id": suite_id, "suite_file": str(suite.path),
                "suite_sha256": hashlib.sha256(text.encode()).hexdigest(), "results": str(out),
                "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "steps": []}
    (out / "suite.yaml").write_text(text)
    env = dict(os.environ)
    for i, s in enumerate(steps, 1):
        echo(f"[{i}/{len(steps)}] {s.title}: {s.command()}")
        log = logs / f"{i:02d}-{s.kind}.log"
        t0 = time.monotonic()
        rc: int
        try:
            with open(log, "w") as fh:
                proc = subprocess.Popen(runner + s.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env)
                assert proc.stdout is not None
                timer = threading.Timer(s.timeout_s, proc.kill) if s.timeout_s else None
                if timer:
                    timer.start()
                for line in proc.stdout:
                    fh.write(line)
                    echo("    " + line.rstrip("\n"))
                rc = proc.wait()
                if timer:
                    timer.cancel()
                    if time.monotonic() - t0 >= s.timeout_s and rc != 0:
                        rc = 124
                        fh.write(f"\n[suite] step killed after timeout_min={s.timeout_s / 60:g}\n")
        except OSError as e:
            raise KvarnError(f"cannot start step {i} ({s.command()}): {e}") from None
        dur = time.monotonic() - t0
        manifest["steps"].append({"index": i, "kind": s.kind, "title": s.title, "command": s.command(),
                                  "exit_code": rc, "seconds": round(dur, 1), "log": str(log)})
        echo(f"[{i}/{len(steps)}] {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {dur:.0f} s")
        (out / "suite-manifest.json").write_text(json.dumps(manifest, indent=2))
        if rc != 0 and fail_fast:
            break
    manifest["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    manifest["failed_steps"] = sum(1 for s in manifest["steps"] if s["exit_code"] != 0)
    manifest["skipped_steps"] = len(steps) - len(manifest["steps"])
    (out / "suite-manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
