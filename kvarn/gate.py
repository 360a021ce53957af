"""`kvarn gate`: compare a new results directory with a stored baseline under a policy; pass, regression or unusable.

How a verdict is reached (perf-eval style, plus baselines and paired accuracy intervals):

1. Every raw bench run of the new results is validated first (status ok, every request completed, throughput
   present). A broken run cannot hide inside a median: under the default policy (`invalid_runs: regression`) one
   invalid repeat makes its cell fail (exit 1); `invalid_runs: unusable` makes it exit 2 instead.
2. Each cell needs an odd number of repeats, at least `repeats.min` (else exit 2: the median would be ill-defined).
   A single-repeat run is gated with `--min-repeats 1` (or `repeats: {min: 1}` in a policy): each cell's one run is
   then its median. A repeat run again (a resumed failure, `kvarn bench --force`) counts once: the newest row of each
   (config_hash, repeat) is judged, and rows of different config hashes are never pooled into one cell
   (kvarn/gate_rows.py).
3. Perf rules compare the median over repeats with the baseline's median (`max_drop_pct`, `max_rise_pct`: floors
   learned from the baseline) and/or with absolute bounds (`min`, `max`). An absolute bound on a ratio vs fp16 is a
   property of one engine and model shape (the transformers engine on a CPU measures 1.8-2.2x where vLLM on the
   Qwen3-8B shape measures 4.5x), so such a rule must select both `engine` and `model`. For each cell and metric
   the first matching rule applies (list specific rules first). A ratio taken against another run's FP16 row
   (cross-run, asked for with `kvarn bench --baseline-run`) says so in its check.
4. Accuracy rules use the paired interval of the change vs fp16 that `kvarn eval` records: a format fails only when
   the whole interval lies below the allowed drop (`max_drop_pp`), i.e. the data exclude an acceptable drop.
   Perplexity rules fail when the whole interval lies above `max_rise_pct`.
5. Exit codes: 0 pass, 1 regression, 2 unusable input (missing/empty results, bad policy, wrong repeat counts,
   nothing to compare: a baseline with no cell in common with the results is one line, or whatever the policy
   routes there). A run gated against itself passes under the built-in policy on any engine.
"""
from __future__ import annotations

import copy
import fnmatch
import math
from pathlib import Path

import pandas as pd
import yaml

from .bench.ratios import CROSS_RUN, UNPAIRED
from .errors import KvarnError, choices
from .gate_rows import add_variants, variant_cells
from .report.data import (CELL_KEYS, FP16_KV, eval_summary, family, load_results, normalise_bench,
                          of_kind)
from .results.current import SUPERSEDED_OK, current_rows

PASS, REGRESSION, UNUSABLE = "pass", "regression", "unusable"
EXIT = {PASS: 0, REGRESSION: 1, UNUSABLE: 2}

# The built-in policy. suites/gates.yaml holds the same thing as data (a test keeps them identical).
DEFAULT_POLICY: dict = {
    "version": 1,
    "repeats": {"min": 3, "odd": True},
    "invalid_runs": "regression",
    "missing_cells": "regression",
    "same_gpu": True,
    "perf": [
        # the measured target of vLLM on these shapes at the 16k showcase burst; elsewhere the baseline sets the floor
        {"name": "kvarn capacity", "metric": "kv_ratio_vs_fp16", "kv_dtype": "kvarn_k4v2_g128", "engine": "vllm",
         "model": ["Qwen/Qwen3-8B", "Qwen/Qwen3-32B"], "burst": 16384, "min": 4.4, "max_drop_pct": 1.0},
        {"name": "capacity", "metric": "kv_ratio_vs_fp16", "max_drop_pct": 1.0},
        {"name": "kvarn throughput", "metric": "output_tok_s", "family": "kvarn", "max_drop_pct": 5.0},
        {"name": "throughput", "metric": "output_tok_s", "max_drop_pct": 7.0},
        {"name": "kvarn speed-up vs fp16", "metric": "output_tok_s_ratio_vs_fp16", "family": "kvarn",
         "max_drop_pct": 5.0},
        {"name": "time to first token p99", "metric": "ttft_ms_p99", "max_rise_pct": 15.0},
        {"name": "time per output token p50", "metric": "tpot_ms_p50", "max_rise_pct": 10.0},
    ],
    "accuracy": [
        {"name": "kvarn accuracy", "family": "kvarn", "max_drop_pp": 2.0},
        {"name": "accuracy", "max_drop_pp": 3.0},
        {"name": "perplexity", "max_rise_pct": 2.0},
    ],
}
_TOP = {"version", "repeats", "invalid_runs", "missing_cells", "same_gpu", "perf", "accuracy", "description"}
_SELECT = {"model", "tp", "kv_dtype", "family", "engine", "mode", "burst", "task"}
RATIO_METRICS = ("kv_ratio_vs_fp16", "output_tok_s_ratio_vs_fp16")
_PERF_BOUNDS = {"min", "max", "max_drop_pct", "max_rise_pct"}
_ACC_BOUNDS = {"max_drop_pp", "max_rise_pct"}
_ROUTES = (REGRESSION, UNUSABLE, "ignore")


# ---- policy ---------------------------------------------------------------------------------------------------------
def load_policy(path: str | Path | None) -> dict:
    if path is None:
        return copy.deepcopy(DEFAULT_POLICY)
    p = Path(path)
    if not p.is_file():
        raise KvarnError(f"policy file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise KvarnError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    return validate_policy(data, str(p))


def validate_policy(data, where: str = "policy") -> dict:
    if not isinstance(data, dict):
        raise KvarnError(f"{where}: expected a mapping with keys {choices(sorted(_TOP))}")
    unknown = set(data) - _TOP
    if unknown:
        raise KvarnError(f"{where}: unknown key {sorted(unknown)[0]!r}; accepted: {choices(sorted(_TOP))}")
    pol = copy.deepcopy(DEFAULT_POLICY)
    pol.update({k: v for k, v in data.items() if k not in ("perf", "accuracy")})
    pol["perf"] = data.get("perf", pol["perf"]) or []
    pol["accuracy"] = data.get("accuracy", pol["accuracy"]) or []
    rep = pol["repeats"]
    if not isinstance(rep, dict) or set(rep) - {"min", "odd"}:
        raise KvarnError(f"{where}: repeats must be a mapping with keys min, odd")
    rep.setdefault("min", 1)
    rep.setdefault("odd", True)
    if not isinstance(rep["min"], int) or rep["min"] < 1:
        raise KvarnError(f"{where}: repeats.min must be a positive integer, got {rep['min']!r}")
    for key in ("invalid_runs", "missing_cells"):
        if pol[key] not in _ROUTES:
            raise KvarnError(f"{where}: {key} must be one of {choices(_ROUTES)}, got {pol[key]!r}")
    for section, bounds in (("perf", _PERF_BOUNDS), ("accuracy", _ACC_BOUNDS)):
        if not isinstance(pol[section], list):
            raise KvarnError(f"{where}: {section} must be a list of rules")
        for i, rule in enumerate(pol[section]):
            if not isinstance(rule, dict):
                raise KvarnError(f"{where}: {section}[{i}] must be a mapping")
            allowed = _SELECT | bounds | {"name", "metric"}
            bad = set(rule) - allowed
            if bad:
                raise KvarnError(f"{where}: {section}[{i}] has unknown key {sorted(bad)[0]!r}; accepted: "
                                 f"{choices(sorted(allowed))}")
            if not set(rule) & bounds:
                raise KvarnError(f"{where}: {section}[{i}] sets no bound; give one of {choices(sorted(bounds))}")
            if section == "perf" and "metric" not in rule:
                raise KvarnError(f"{where}: perf[{i}] needs a metric (a bench column such as output_tok_s)")
            for b in set(rule) & bounds:
                if not isinstance(rule[b], (int, float)) or isinstance(rule[b], bool):
                    raise KvarnError(f"{where}: {section}[{i}].{b} must be a number, got {rule[b]!r}")
            if section == "perf" and rule["metric"] in RATIO_METRICS and {"min", "max"} & set(rule) and not (
                    {"engine", "model"} <= set(rule)):
                raise KvarnError(f"{where}: perf[{i}] ({rule.get('name') or rule['metric']}): an absolute bound on "
                                 f"{rule['metric']} holds for one engine and model shape; add engine and model "
                                 "selectors, or use max_drop_pct (a floor learned from the baseline)")
    return pol


def _match(rule: dict, rec: dict) -> bool:
    for key in _SELECT & set(rule):
        want = rule[key]
        have = family(str(rec.get("kv_dtype", ""))) if key == "family" else rec.get(key)
        wants = want if isinstance(want, list) else [want]
        ok = False
        for w in wants:
            if isinstance(w, str):
                ok = ok or fnmatch.fnmatchcase(str(have), w)
            else:
                try:
                    ok = ok or float(have) == float(w)
                except (TypeError, ValueError):
                    pass
        if not ok:
            return False
    return True


# ---- helpers --------------------------------------------------------------------------------------------------------
def _isnum(v) -> bool:
    try:
        return v is not None and not math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def cell_label(rec: dict) -> str:
    parts = [str(rec.get("model")), f"TP={int(rec['tp'])}" if _isnum(rec.get("tp")) else "", str(rec.get("kv_dtype"))]
    if rec.get("task"):
        parts.append(f"task {rec['task']}")
    else:
        if rec.get("mode"):
            parts.append(str(rec["mode"]))
        if _isnum(rec.get("burst")):
            parts.append(f"burst {int(rec['burst'])}")
        if rec.get("variant"):
            parts.append(str(rec["variant"]))
    return " · ".join(p for p in parts if p)


def _key(rec: dict, keys) -> tuple:
    out = []
    for k in keys:
        v = rec.get(k)
        if _isnum(v) and not isinstance(v, str):
            v = float(v)
        elif v is None or (isinstance(v, float) and math.isnan(v)):
            v = None
        out.append(v)
    return tuple(out)


def _cell_dict(rec: dict) -> dict:
    d = {}
    for k in CELL_KEYS:
        v = rec.get(k)
        if _isnum(v) and not isinstance(v, str):
            v = int(v) if float(v).is_integer() else float(v)
        elif isinstance(v, float):
            v = None
        d[k] = v
    if rec.get("variant"):
        d["variant"] = rec["variant"]
    return d


class _Verdict:
    def __init__(self):
        self.checks: list[dict] = []
        self.invalid_runs: list[dict] = []
        self.problems: list[dict] = []  # unusable-input findings
        self.notes: list[str] = []

    def problem(self, msg: str, **extra):
        self.problems.append({"message": msg, **extra})


# ---- the gate -------------------------------------------------------------------------------------------------------
def run_gate(results, baseline, policy: dict | None = None, *, policy_source: str = "built-in",
             min_repeats: int | None = None) -> dict:
    """Return the verdict dict (see module doc); raises KvarnError for input that cannot be read at all and for a
    baseline with no cell in common with the results. `min_repeats` overrides the policy's repeats.min."""
    policy = validate_policy(policy, policy_source) if policy is not None else copy.deepcopy(DEFAULT_POLICY)
    if min_repeats is not None:
        if min_repeats < 1:
            raise KvarnError(f"--min-repeats must be >= 1, got {min_repeats}")
        policy["repeats"]["min"] = min_repeats
    new_df = load_results(results)
    base_df = load_results(baseline)
    v = _Verdict()

    new_b, old = current_rows(of_kind(new_df, "bench"))
    base_b, _ = current_rows(of_kind(base_df, "bench"))
    n_old = len(old)
    if n_old:
        v.notes.append(f"{results}: {n_old} bench row{'s' if n_old > 1 else ''} superseded by a newer row of the same "
                       "configuration and repeat (a resumed or forced rerun): the newest row of each counts")
    new_e = of_kind(new_df, "eval")
    if new_b.empty and new_e.empty:
        v.problem(f"{results}: no bench or eval rows to gate")
    if policy.get("same_gpu"):
        g_new = sorted(set(new_df.get("gpu_name", pd.Series(dtype=str)).dropna().astype(str)) - {"", "None"})
        g_base = sorted(set(base_df.get("gpu_name", pd.Series(dtype=str)).dropna().astype(str)) - {"", "None"})
        if g_new and g_base and g_new != g_base:
            v.problem(f"GPU differs from the baseline ({', '.join(g_new)} vs {', '.join(g_base)}): relative "
                      "bounds would measure hardware, not code (policy same_gpu: true)")

    _check_overlap(results, baseline, new_b, base_b, new_e, of_kind(base_df, "eval"))
    if not new_b.empty:
        _gate_perf(new_b, base_b, policy, v)
    if not new_e.empty:
        _gate_accuracy(new_e, of_kind(base_df, "eval"), policy, v)
    if not v.checks and not v.problems:
        v.problem("no check applied: no rule of the policy matched a cell present in the results")
    _fold_repeat_problems(v)

    fails = [c for c in v.checks if c["status"] == "fail"]
    verdict = UNUSABLE if v.problems else (REGRESSION if fails else PASS)
    run_ids = sorted(set(new_df.get("run_id", pd.Series(dtype=str)).dropna().astype(str)))
    base_ids = sorted(set(base_df.get("run_id", pd.Series(dtype=str)).dropna().astype(str)))
    return {
        "verdict": verdict,
        "exit_code": EXIT[verdict],
        "results": str(results), "baseline": str(baseline), "policy_source": policy_source,
        "run_ids": run_ids, "baseline_run_ids": base_ids,
        "summary": {"checks": len(v.checks), "passed": sum(c["status"] == "pass" for c in v.checks),
                    "failed": len(fails), "invalid_runs": len(v.invalid_runs), "problems": len(v.problems)},
        "problems": v.problems,
        "invalid_runs": v.invalid_runs,
        "checks": v.checks,
        "notes": v.notes,
        "policy": policy,
    }


def _check_overlap(results, baseline, new_b, base_b, new_e, base_e) -> None:
    """A baseline that shares no cell with the results compares nothing: one line, not a failure per cell."""
    def bench_keys(df):
        if df.empty:
            return set()
        return {_key(r, CELL_KEYS) for r in normalise_bench(df).to_dict("records")}

    def eval_keys(df):
        if df.empty:
            return set()
        return {(r.get("model"), int(r["tp"]) if _isnum(r.get("tp")) else 1, r.get("task"), r.get("kv_dtype"))
                for r in df.to_dict("records")}

    nb, bb, ne, be = bench_keys(new_b), bench_keys(base_b), eval_keys(new_e), eval_keys(base_e)
    if (bb or be) and not (nb & bb) and not (ne & be):
        def say(keys, bench: bool):
            if not keys:
                return "no cells"
            k = sorted(keys, key=str)[0]
            rec = dict(zip(CELL_KEYS, k)) if bench else dict(zip(("model", "tp", "task", "kv_dtype"), k))
            return f"{len(keys)} cell{'s' if len(keys) > 1 else ''}, e.g. {cell_label(rec)}"

        have = say(nb, True) if nb else say(ne, False)
        base = say(bb, True) if bb else say(be, False)
        raise KvarnError(f"baseline {baseline} has no cell in common with {results} (results: {have}; baseline: "
                         f"{base}): nothing to compare; gate against a baseline of the same model, engine and workload")


def _fold_repeat_problems(v: _Verdict) -> None:
    """Cells with too few repeats are one problem with the way out, not one line per cell."""
    rep = [p for p in v.problems if p.get("repeats_problem")]
    if not rep:
        return
    first = rep[0]["message"]
    rest = [p for p in v.problems if not p.get("repeats_problem")]
    more = f" (and {len(rep) - 1} more cells)" if len(rep) > 1 else ""
    odd = all(p.get("repeats", 0) % 2 == 1 for p in rep)
    how = (" To gate it as it is, give --min-repeats 1 (policy key repeats.min); for medians over several runs, "
           "rerun with kvarn bench --repeat 3." if odd else
           " Rerun with an odd number of repeats (kvarn bench --repeat 3) so each median is one real run.")
    v.problems = rest + [{"message": first + more + "." + how, "cells": [p.get("cell") for p in rep]}]


def _gate_perf(new_b: pd.DataFrame, base_b: pd.DataFrame, policy: dict, v: _Verdict) -> None:
    nb = normalise_bench(new_b)
    bb = normalise_bench(base_b) if not base_b.empty else pd.DataFrame()
    add_variants(nb, bb)
    keys = list(CELL_KEYS) + ["variant"]
    new_cells = variant_cells(nb)
    base_cells = variant_cells(bb)
    base_map = {_key(r, keys): r for r in base_cells.to_dict("records")} if not base_cells.empty else {}
    rep = policy["repeats"]
    invalid_route = policy["invalid_runs"]

    for rec in new_cells.to_dict("records"):
        cell = _cell_dict(rec)
        label = cell_label(rec)
        raw = nb[[(_key(r, keys) == _key(rec, keys)) for r in nb[keys].to_dict("records")]]
        n = int(raw["repeat"].nunique()) if "repeat" in raw else len(raw)
        bad = raw[~raw["valid"]]
        for r in bad.to_dict("records"):
            reason = r.get("invalid_reason")
            if r.get(SUPERSEDED_OK):
                reason = (f"{reason} (a newer run of this repeat after an ok one; rerun it with kvarn bench --force, "
                          "as the newest row counts)")
            entry = {"cell": cell, "label": label, "repeat": int(r["repeat"]) if _isnum(r.get("repeat")) else None,
                     "status": r.get("status"), "reason": reason, "run_id": r.get("run_id"),
                     "completed": r.get("completed") if _isnum(r.get("completed")) else None,
                     "num_requests": r.get("num_requests") if _isnum(r.get("num_requests")) else None}
            v.invalid_runs.append(entry)
        if len(bad) and invalid_route == UNUSABLE:
            v.problem(f"{label}: {len(bad)} of {n} runs invalid ({bad['invalid_reason'].iloc[0]})", cell=cell)
        n_valid = len(raw) - len(bad)
        if n < rep["min"] or (rep["odd"] and n % 2 == 0):
            v.problem(f"{label}: {n} repeat(s); the policy needs an odd number >= {rep['min']} so the median is "
                      "one real run", cell=cell, repeats_problem=True, repeats=n)
        elif (not len(bad) or invalid_route == "ignore") and n_valid != n and (
                n_valid < rep["min"] or (rep["odd"] and n_valid % 2 == 0)):
            # the median runs over the valid rows: an ignored invalid run (or rows without a config hash, which
            # cannot be told apart from a rerun) changes their count
            v.problem(f"{label}: the median would run over {n_valid} valid runs for {n} repeat(s); the policy "
                      f"needs an odd number >= {rep['min']} so the median is one real run. Rerun kvarn bench into "
                      "the same directory: it reruns the failed repeats, and the newest row of each repeat counts",
                      cell=cell)
        if len(bad) and invalid_route == REGRESSION:
            v.checks.append({"kind": "validity", "cell": cell, "label": label, "metric": "valid runs",
                             "rule": "every raw run ok and complete", "new": len(raw) - len(bad), "repeats": n,
                             "baseline": None, "change_pct": None, "bound": f"{n} of {n}", "status": "fail",
                             "message": f"{len(bad)} of {n} runs invalid: "
                                        + "; ".join(sorted(set(bad['invalid_reason'].astype(str))))})
        base = base_map.get(_key(rec, keys))
        if base is None:
            v.notes.append(f"{label}: not in the baseline (new cell): only absolute bounds apply")
        elif base.get("valid_runs", 0) == 0:
            v.notes.append(f"{label}: the baseline has no valid run: only absolute bounds apply")
            base = None
        done_metrics: set[str] = set()
        unpaired: list[str] = []
        for rule in policy["perf"]:
            m = rule["metric"]
            if m in done_metrics or not _match(rule, rec):
                continue
            new_val = rec.get(m)
            base_val = base.get(m) if base is not None else None
            if not _isnum(new_val) and not _isnum(base_val):
                continue  # the metric does not exist for this cell (e.g. latency in throughput mode)
            done_metrics.add(m)
            if m in RATIO_METRICS and not _isnum(new_val) and UNPAIRED in str(rec.get("ratio_scope") or ""):
                unpaired.append(m)  # no FP16 row of its run: the input cannot answer, the code did not regress
                continue
            v.checks.append(_perf_check(rule, cell, label, m, new_val, base_val, rec))
        if unpaired:
            v.problem(f"{label}: {', '.join(unpaired)} unpaired (run {rec.get('run_id') or '?'} has no FP16 row of "
                      f"this setting to take the ratio against): rerun it with its FP16 cell in one run, kvarn bench "
                      f"--force --kv-dtype auto,{rec.get('kv_dtype')} and the same other options, or give "
                      "--baseline-run RUN_ID for a cross-run ratio",
                      cell=cell)

    present = {_key(r, keys) for r in new_cells.to_dict("records")}
    for k, b in base_map.items():
        if k in present or policy["missing_cells"] == "ignore":
            continue
        label = cell_label(b)
        msg = f"{label}: in the baseline but missing from the new results"
        if policy["missing_cells"] == UNUSABLE:
            v.problem(msg, cell=_cell_dict(b))
        else:
            v.checks.append({"kind": "coverage", "cell": _cell_dict(b), "label": label, "metric": "cell present",
                             "rule": "missing_cells", "new": None, "repeats": 0, "baseline": None, "change_pct": None,
                             "bound": "present", "status": "fail", "message": msg})


def _cross_run(rec: dict, metric: str) -> str:
    """' (cross-run: FP16 of run X)' when a ratio metric was taken against another run's FP16 row."""
    if metric not in RATIO_METRICS or CROSS_RUN not in str(rec.get("ratio_scope") or ""):
        return ""
    return f"cross-run ratio: FP16 of run {rec.get('fp16_run_id') or '?'}"


def _perf_check(rule, cell, label, metric, new_val, base_val, rec) -> dict:
    chk = _perf_bounds(rule, cell, label, metric, new_val, base_val, rec)
    note = _cross_run(rec, metric)
    if note:
        chk["message"] = f"{chk['message']}; {note}" if chk["message"] else note
        chk["cross_run"] = True
    return chk


def _perf_bounds(rule, cell, label, metric, new_val, base_val, rec) -> dict:
    name = rule.get("name") or metric
    chk = {"kind": "perf", "cell": cell, "label": label, "metric": metric, "rule": name,
           "new": float(new_val) if _isnum(new_val) else None, "repeats": int(rec.get("valid_runs", 0)),
           "runs": int(rec.get("runs", 0)),
           "baseline": float(base_val) if _isnum(base_val) else None, "change_pct": None, "bound": "",
           "status": "pass", "message": ""}
    if not _isnum(new_val):
        chk.update(status="fail", message=f"{metric} missing from the new results (baseline has it)")
        return chk
    new_val = float(new_val)
    reasons, bounds = [], []
    if _isnum(base_val) and float(base_val) != 0:
        chk["change_pct"] = (new_val / float(base_val) - 1) * 100
    if "min" in rule:
        bounds.append(f">= {rule['min']:g}")
        if new_val < rule["min"]:
            reasons.append(f"{new_val:.4g} < min {rule['min']:g}")
    if "max" in rule:
        bounds.append(f"<= {rule['max']:g}")
        if new_val > rule["max"]:
            reasons.append(f"{new_val:.4g} > max {rule['max']:g}")
    if "max_drop_pct" in rule:
        bounds.append(f"drop <= {rule['max_drop_pct']:g}%")
        if chk["change_pct"] is not None and -chk["change_pct"] > rule["max_drop_pct"]:
            reasons.append(f"dropped {-chk['change_pct']:.1f}% vs baseline (allowed {rule['max_drop_pct']:g}%)")
    if "max_rise_pct" in rule:
        bounds.append(f"rise <= {rule['max_rise_pct']:g}%")
        if chk["change_pct"] is not None and chk["change_pct"] > rule["max_rise_pct"]:
            reasons.append(f"rose {chk['change_pct']:.1f}% vs baseline (allowed {rule['max_rise_pct']:g}%)")
    if chk["change_pct"] is None and not ({"min", "max"} & set(rule)):
        chk["status"] = "skip"
        chk["message"] = "no baseline value: relative bound not applied"
    chk["bound"] = ", ".join(bounds)
    if reasons:
        chk.update(status="fail", message="; ".join(reasons))
    return chk


def _gate_accuracy(new_e: pd.DataFrame, base_e: pd.DataFrame, policy: dict, v: _Verdict) -> None:
    ev = eval_summary(new_e)
    failed = new_e[new_e["status"] != "ok"]
    ok_at = ({(r["model"], int(r["tp"]), r["task"], r["kv_dtype"]): r.get("created_at") for r in ev.to_dict("records")}
             if not ev.empty else {})
    for r in failed.to_dict("records"):
        tp = int(r["tp"]) if _isnum(r.get("tp")) else 1
        key = (r.get("model"), tp, r.get("task"), r.get("kv_dtype"))
        if key in ok_at:
            ok_t, fail_t = ok_at[key], r.get("created_at")
            if not (isinstance(ok_t, str) and isinstance(fail_t, str)) or ok_t > fail_t:
                continue  # a later retry succeeded (ev holds the latest ok row of each key)
        label = cell_label({**r, "tp": tp})
        entry = {"cell": {"model": r.get("model"), "tp": tp, "task": r.get("task"), "kv_dtype": r.get("kv_dtype")},
                 "label": label, "repeat": None, "status": r.get("status"), "reason": str(r.get("error") or ""),
                 "run_id": r.get("run_id")}
        v.invalid_runs.append(entry)
        if policy["invalid_runs"] == UNUSABLE:
            v.problem(f"{label}: eval {r.get('status')}", cell=entry["cell"])
        else:
            v.checks.append({"kind": "validity", "cell": entry["cell"], "label": label, "metric": "eval status",
                             "rule": "eval ok", "new": None, "baseline": None, "change_pct": None, "bound": "ok",
                             "status": "fail", "message": f"eval {r.get('status')}: {entry['reason']}".strip(": ")})
    base = eval_summary(base_e) if not base_e.empty else pd.DataFrame()
    base_map = {(r["model"], int(r["tp"]), r["task"], r["kv_dtype"]): r for r in base.to_dict("records")}
    for rec in ev.to_dict("records"):
        if rec["kv_dtype"] in FP16_KV:
            continue
        is_acc = _isnum(rec.get("accuracy"))
        for rule in policy["accuracy"]:
            if rule.get("metric") and rule["metric"] != ("accuracy" if is_acc else "ppl"):
                continue
            if not _match(rule, rec):
                continue
            if is_acc and "max_drop_pp" not in rule or not is_acc and "max_rise_pct" not in rule:
                continue
            b = base_map.get((rec["model"], int(rec["tp"]), rec["task"], rec["kv_dtype"]))
            v.checks.append(_acc_check(rule, rec, b, is_acc))
            break
    if policy["missing_cells"] != "ignore":
        present = {(r["model"], int(r["tp"]), r["task"], r["kv_dtype"]) for r in ev.to_dict("records")}
        present |= {(r.get("model"), int(r["tp"]) if _isnum(r.get("tp")) else 1, r.get("task"), r.get("kv_dtype"))
                    for r in failed.to_dict("records")}
        for k in sorted(set(base_map) - present, key=str):
            label = cell_label({"model": k[0], "tp": k[1], "task": k[2], "kv_dtype": k[3]})
            msg = f"{label}: in the baseline but missing from the new results"
            if policy["missing_cells"] == UNUSABLE:
                v.problem(msg)
            else:
                v.checks.append({"kind": "coverage", "cell": dict(zip(("model", "tp", "task", "kv_dtype"), k)),
                                 "label": label, "metric": "eval present", "rule": "missing_cells", "new": None,
                                 "baseline": None, "change_pct": None, "bound": "present", "status": "fail",
                                 "message": msg})


def _acc_check(rule, rec, base, is_acc) -> dict:
    cell = {"model": rec["model"], "tp": int(rec["tp"]), "task": rec["task"], "kv_dtype": rec["kv_dtype"]}
    label = cell_label(rec)
    d, lo, hi = (rec.get(c) for c in ("delta_vs_fp16", "delta_ci_low", "delta_ci_high"))
    chk = {"kind": "accuracy", "cell": cell, "label": label, "rule": rule.get("name") or "accuracy",
           "metric": "accuracy Δ vs fp16 (pp)" if is_acc else "ppl rise vs fp16 (%)", "status": "pass",
           "new": None, "interval": None, "baseline": None, "change_pct": None, "bound": "", "message": ""}
    if not _isnum(d):
        chk.update(status="fail", message="no paired change vs fp16 recorded (is the fp16 eval missing?)")
        return chk
    if is_acc:
        allowed = float(rule["max_drop_pp"])
        dd = float(d) * 100
        lo_, hi_ = (float(lo) * 100 if _isnum(lo) else dd), (float(hi) * 100 if _isnum(hi) else dd)
        chk.update(new=dd, interval=[lo_, hi_], bound=f"interval not entirely below −{allowed:g} pp")
        if base is not None and _isnum(base.get("delta_vs_fp16")):
            chk["baseline"] = float(base["delta_vs_fp16"]) * 100
        if not (_isnum(lo) and _isnum(hi)):
            chk["message"] = "no interval recorded: judged on the point estimate"
        if hi_ < -allowed:
            chk.update(status="fail", message=f"Δ {dd:+.2f} pp, interval [{lo_:+.2f}, {hi_:+.2f}] lies below "
                                              f"the allowed −{allowed:g} pp")
        elif lo_ < -allowed:
            chk["message"] = (f"interval [{lo_:+.2f}, {hi_:+.2f}] includes the allowed −{allowed:g} pp: "
                              "not a significant regression")
    else:
        allowed = float(rule["max_rise_pct"])
        ppl = float(rec.get("ppl")) if _isnum(rec.get("ppl")) else math.nan
        ref = ppl - float(d)
        to_pct = (lambda x: float(x) / ref * 100) if ref and not math.isnan(ref) else (lambda x: math.nan)
        dd = to_pct(d)
        lo_ = to_pct(lo) if _isnum(lo) else dd
        hi_ = to_pct(hi) if _isnum(hi) else dd
        chk.update(new=dd, interval=[lo_, hi_], bound=f"interval not entirely above +{allowed:g}%")
        if base is not None and _isnum(base.get("delta_vs_fp16")) and _isnum(base.get("ppl")):
            bref = float(base["ppl"]) - float(base["delta_vs_fp16"])
            chk["baseline"] = float(base["delta_vs_fp16"]) / bref * 100 if bref else None
        if lo_ > allowed:
            chk.update(status="fail", message=f"perplexity +{dd:.2f}%, interval [{lo_:+.2f}, {hi_:+.2f}]% lies "
                                              f"above the allowed +{allowed:g}%")
    return chk


# ---- output ---------------------------------------------------------------------------------------------------------
def _n(v, fmt="{:.4g}") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def markdown(verdict: dict, max_rows: int = 200) -> str:
    icon = {PASS: "✅", REGRESSION: "❌", UNUSABLE: "⚠️"}[verdict["verdict"]]
    s = verdict["summary"]
    lines = [f"## kvarn gate: {icon} {verdict['verdict']} (exit {verdict['exit_code']})", "",
             f"new `{verdict['results']}` vs baseline `{verdict['baseline']}` · policy: {verdict['policy_source']}",
             "",
             f"| checks | passed | failed | invalid runs | unusable-input problems |",
             "|---:|---:|---:|---:|---:|",
             f"| {s['checks']} | {s['passed']} | {s['failed']} | {s['invalid_runs']} | {s['problems']} |", ""]
    if verdict["problems"]:
        lines += ["### Unusable input", ""] + [f"- {p['message']}" for p in verdict["problems"]] + [""]
    fails = [c for c in verdict["checks"] if c["status"] == "fail"]
    if fails:
        lines += ["### Regressions", "", "| cell | metric | new | baseline | change | bound | why |",
                  "|---|---|---:|---:|---:|---|---|"]
        for c in fails[:max_rows]:
            lines.append(f"| {c['label']} | {c['metric']} | {_n(c['new'])} | {_n(c['baseline'])} | "
                         f"{_n(c.get('change_pct'), '{:+.1f}%')} | {c['bound']} | {c['message']} |")
        lines.append("")
    if verdict["invalid_runs"]:
        lines += ["### Invalid runs (validated before any median)", "", "| cell | repeat | status | reason | run |",
                  "|---|---:|---|---|---|"]
        for r in verdict["invalid_runs"][:max_rows]:
            lines.append(f"| {r['label']} | {_n(r.get('repeat'), '{:d}')} | {r.get('status')} | {r.get('reason')} | "
                         f"{r.get('run_id') or ''} |")
        lines.append("")
    rest = [c for c in verdict["checks"] if c["status"] != "fail"]
    if rest:
        lines += ["<details><summary>All passing checks</summary>", "",
                  "| cell | metric | new (median) | baseline | change | bound | note |", "|---|---|---:|---:|---:|---|---|"]
        for c in rest[:max_rows]:
            new = _n(c["new"])
            if c.get("interval"):
                new += f" [{c['interval'][0]:+.2f}, {c['interval'][1]:+.2f}]"
            lines.append(f"| {c['label']} | {c['metric']} | {new} | {_n(c['baseline'])} | "
                         f"{_n(c.get('change_pct'), '{:+.1f}%')} | {c['bound']} | {c['message']} |")
        if len(rest) > max_rows:
            lines.append(f"| … {len(rest) - max_rows} more in the JSON verdict | | | | | | |")
        lines += ["", "</details>", ""]
    return "\n".join(lines)
