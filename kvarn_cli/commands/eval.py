"""`kvarn eval`: accuracy / fidelity tasks over KV-cache formats with paired statistics against fp16."""
from __future__ import annotations

import json
import math

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvarn.errors import KvarnError
from kvarn.tablefit import drop_to_fit, natural_width

from ..console import err, err_console, out, print_json


class RichReporter:
    def __init__(self):
        self.progress = None
        self.task = None

    def info(self, msg: str) -> None:
        err(msg)

    def start(self, label: str, total: int) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=err_console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task(label, total=total)

    def advance(self, n: int = 1) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, n)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.progress = None


def _f(v, fmt="{:.3f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def _cells(rows: list[dict], is_ppl: bool, dp: int) -> list[dict]:
    pct = lambda v, f="{:.1f}": _f(v * 100 if isinstance(v, (int, float)) else v, f)  # noqa: E731
    num, sig = f"{{:.{dp}f}}", f"{{:+.{dp}f}}"
    cells = []
    for r in rows:
        c = {"kv dtype": r["kv_dtype"], "status": r["status"], "n": _f(r.get("n"), "{:.0f}")}
        if is_ppl:
            c["ppl [95% CI]"] = f"{_f(r.get('ppl'), num)} [{_f(r.get('ci_low'), num)}, {_f(r.get('ci_high'), num)}]"
            c["Δ vs fp16 [95% CI]"] = (f"{_f(r.get('delta_vs_fp16'), sig)} [{_f(r.get('delta_ci_low'), sig)}, "
                                       f"{_f(r.get('delta_ci_high'), sig)}]")
            c["rise %"] = _f(r.get("ppl_rise_pct"), "{:+.2f}")
        else:
            acc = f"{pct(r.get('accuracy'))}% [{pct(r.get('ci_low'))}, {pct(r.get('ci_high'))}]"
            if r.get("accuracy_flexible") is not None and not math.isnan(r.get("accuracy_flexible", math.nan)):
                acc += f" (flex {pct(r['accuracy_flexible'])}%)"
            c["accuracy [95% CI]"] = acc
            c["Δ vs fp16 pp [95% CI]"] = (f"{pct(r.get('delta_vs_fp16'), '{:+.1f}')} "
                                          f"[{pct(r.get('delta_ci_low'), '{:+.1f}')}, "
                                          f"{pct(r.get('delta_ci_high'), '{:+.1f}')}]")
            c["McNemar p"] = _f(r.get("mcnemar_p"), "{:.3g}")
            c["pass@k"] = pct(r.get("pass_at_k"))
            c["trunc %"] = pct(r.get("truncation_rate"))
            c["gen tok"] = _f(r.get("mean_gen_tokens"), "{:.0f}")
        cells.append(c)
    return cells


def render(rows: list[dict], width: int | None = None) -> Table:
    """One line per format. pass@k only with K > 1 samples (else it is the accuracy); what every row shares (n, status
    ok) goes in the title. In a narrow terminal: ppl with 2 decimals, then the least-read columns go (generated tokens,
    McNemar p, truncation) rather than every cell folding."""
    task = rows[0]["task"] if rows else ""
    is_ppl = any(r.get("metric") == "ppl" for r in rows)
    title = f"kvarn eval {task}: {rows[0].get('model', '')} ({rows[0].get('engine', '')})" if rows else ""
    cells = _cells(rows, is_ppl, 3)
    cols = list(cells[0]) if cells else ["kv dtype", "status", "n"]
    if "pass@k" in cols and all((r.get("samples_k") or 1) <= 1 for r in rows):
        cols.remove("pass@k")
    if cells and all(c["status"] == "ok" for c in cells):
        cols.remove("status")
    if cells and len({c["n"] for c in cells}) == 1:
        cols.remove("n")
        title += f", n = {cells[0]['n']}"
    if width is not None and cells and is_ppl and natural_width(cells, cols) > width:
        cells = _cells(rows, is_ppl, 2)
    cols = drop_to_fit(cells, cols, ("gen tok", "McNemar p", "trunc %", "pass@k"), width)
    t = Table(title=title)
    for c in cols:
        t.add_column(c, no_wrap=c in ("kv dtype", "status", "n") or width is not None,
                     justify="left" if c in ("kv dtype", "status") else "right")
    for c in cells:
        t.add_row(*(c[k] for k in cols))
    return t


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_(
        task_arg: str = typer.Argument(None, metavar="TASK", help="aime25, aime24, gsm8k, math500, niah, ppl."),
        task: str = typer.Option(None, "--task", help="Same as TASK (for scripts and suites)."),
        model: str = typer.Option("smollm2-135m", "--model", "-m",
                                  help="Model name recorded in results; also what is loaded unless --weights."),
        weights: str = typer.Option(None, "--weights", help="Weights to load (local HF folder); default: --model."),
        kv_dtype: str = typer.Option("auto,kvarn_k4v2_g128", "--kv-dtype", "--kv-cache-dtype",
                                     help="Comma list; the fp16 baseline `auto` is always included and run first."),
        engine: str = typer.Option("auto", "--engine", help="auto | vllm | hf (auto: vLLM if it and a GPU exist)."),
        tp: str = typer.Option("1", "--tp", "--tensor-parallel-size", metavar="N",
                               help="Tensor-parallel size (vLLM's --tensor-parallel-size; hf: 1)."),
        limit: int = typer.Option(None, "--limit", help="First N problems / ppl windows; niah: N per context length."),
        samples: int = typer.Option(1, "--samples", help="K sampled answers per problem: avg@K and pass@K."),
        temperature: float = typer.Option(None, "--temperature", help="Default 0 (greedy); 0.6 when --samples > 1."),
        top_p: float = typer.Option(None, "--top-p", help="Default 1.0 greedy, 0.95 sampled."),
        max_tokens: int = typer.Option(None, "--max-tokens",
                                       help="New tokens per answer (default: the task's: aime 32768, gsm8k 256, niah 16)."),
        context: str = typer.Option(None, "--context", help="niah lengths (2k,4k,8k; default 2k); ppl window (1024)."),
        chat: bool = typer.Option(None, "--chat/--no-chat",
                                  help="Wrap prompts in the model's chat template (default: the task's protocol: "
                                       "math500_cot chat, the others completion)."),
        thinking: bool = typer.Option(None, "--thinking/--no-thinking",
                                      help="Chat template enable_thinking; scoring reads after </think>."),
        data: str = typer.Option(None, "--data", help="Local data: jsonl/json/parquet/csv (text file for ppl/niah)."),
        seed: int = typer.Option(0, "--seed"),
        out_dir: str = typer.Option("results", "--out", help="Results store directory."),
        chunk: int = typer.Option(None, "--chunk",
                                  help="Prefill chunk in tokens (ppl default 128, niah 512): later chunks read the "
                                       "quantized cache."),
        fewshot: int = typer.Option(None, "--fewshot", "--num-fewshot", help="gsm8k shots (default 5, as lm-eval)."),
        needle: str = typer.Option("kv", "--needle", help="niah needle: kv (key-value) | passkey."),
        depth: str = typer.Option(None, "--depth", help="niah needle depths: fractions or percents, e.g. 0,0.5,1 or "
                                                        "10%,90% (default: --limit evenly spaced, 10)."),
        resume: bool = typer.Option(True, "--resume/--no-resume", help="Skip (config, sample) pairs already stored."),
        timeout: float = typer.Option(None, "--timeout", help="Seconds per kv dtype's engine run (vllm, lm-eval); "
                                      "default 3600."),
        harness: str = typer.Option("kvarn", "--harness", help="kvarn (built-in tasks) | lm-eval."),
        tasks: str = typer.Option(None, "--tasks", help="lm-eval's spelling: task names, comma list with "
                                  "--harness lm-eval; one built-in task otherwise (same as TASK)."),
        concurrency: int = typer.Option(1, "--concurrency", metavar="N",
                                        help="vLLM: run N kv dtypes side by side on one GPU, each with 1/N of "
                                             "--gpu-memory-utilization (small models leave most of a GPU idle)."),
        model_args: str = typer.Option(None, "--model-args", help="vLLM engine args k=v,... (lm-eval: its "
                                       "model_args), e.g. enable_prefix_caching=false,max_num_seqs=1."),
        gen_kwargs: str = typer.Option(None, "--gen-kwargs", help="lm-eval gen_kwargs, e.g. max_gen_toks=2048."),
        json_: bool = typer.Option(False, "--json", help="Print the summary rows as JSON lines."),
        dtype: str = typer.Option(None, "--dtype", metavar="auto|float16|bfloat16|float32",
                                  help="Model dtype, as vLLM's --dtype (auto: the model config's). Default: vllm "
                                       "auto; hf transformers' choice (float32 for the shipped SmolLM2)."),
    ) -> None:
        """Accuracy and fidelity of KV formats vs the fp16 cache: n, score, 95% CI, paired Δ with its CI.

        Per-sample rows (kind=sample) and summaries (kind=eval) go to the results store in --out; a rerun resumes.
        """
        from kvarn.bench.parsing import parse_tp

        tp = parse_tp(tp)
        if timeout is not None and timeout <= 0:
            raise KvarnError(f"--timeout must be > 0 seconds, got {timeout:g}")
        timeout_min = timeout / 60.0 if timeout is not None else 60.0
        reporter = RichReporter()
        h = (harness or "kvarn").lower()
        if h in ("lm-eval", "lm_eval", "lmeval"):
            from kvarn.eval.harness import run_harness

            # lm-eval's task config decides these; a value given here would be silently ignored
            unused = [flag for flag, given in (
                ("--engine", engine not in ("auto", "vllm")), ("--samples", samples != 1),
                ("--temperature", temperature is not None), ("--top-p", top_p is not None),
                ("--max-tokens", max_tokens is not None), ("--context", context is not None),
                ("--thinking", thinking is not None), ("--data", data is not None), ("--chunk", chunk is not None),
                ("--needle", needle != "kv"), ("--depth", depth is not None), ("--no-resume", not resume),
                ("--dtype", dtype is not None)) if given]
            if unused:
                raise KvarnError(f"not used with --harness lm-eval: {', '.join(unused)} (it runs vLLM with each "
                                 "task's own settings); pass generation settings as --gen-kwargs, engine ones as "
                                 "--model-args")

            names = [t.strip() for t in (tasks or task or task_arg or "").split(",") if t.strip()]
            rows = run_harness(names, kv_dtype, model, weights, tp=tp, limit=limit, seed=seed, out=out_dir,
                               chat=bool(chat), fewshot=fewshot, gen_kwargs=gen_kwargs, extra_model_args=model_args,
                               timeout_min=timeout_min, reporter=reporter)
        elif h == "kvarn":
            if task_arg and task and task_arg != task:
                raise KvarnError(f"two tasks given: {task_arg!r} and --task {task!r}")
            listed = [t.strip() for t in (tasks or "").split(",") if t.strip()]
            if len(listed) > 1:  # lm-eval's spelling of one built-in task is fine; several run one by one
                raise KvarnError(f"--tasks {tasks!r}: the built-in harness runs one task per call; give one, e.g. "
                                 f"--tasks {listed[0]} (several tasks: --harness lm-eval, or a suite)")
            given = {n for n in (task_arg, task, *listed) if n}
            if len(given) > 1:
                raise KvarnError(f"two tasks given: {', '.join(sorted(given))}; give one")
            name = next(iter(given), None)
            if not name:
                from kvarn.eval import task_names

                raise KvarnError(f"give a task: kvarn eval TASK; accepted: {', '.join(task_names())}")
            from kvarn.eval.runner import EvalOptions, run_eval

            o = EvalOptions(task=name, model=model, weights=weights, kv_dtypes=kv_dtype, engine=engine, tp=tp,
                            limit=limit, samples=samples, temperature=temperature, top_p=top_p,
                            max_tokens=max_tokens, context=context, chat=chat, thinking=thinking, data=data,
                            seed=seed, out=out_dir, chunk=chunk, fewshot=fewshot, needle=needle, depth=depth,
                            resume=resume, timeout_min=timeout_min, model_args=model_args,
                            concurrency=concurrency, dtype=dtype)
            rows = run_eval(o, reporter)
        else:
            raise KvarnError(f"unknown --harness {harness!r}; accepted: kvarn, lm-eval")
        if json_:
            for r in rows:
                print_json({k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))})
        else:
            by_task: dict[str, list[dict]] = {}
            for r in rows:
                by_task.setdefault(r["task"], []).append(r)
            for group in by_task.values():
                out.print(render(group, width=out.width))
                for r in group:
                    for col, what in (("by_context", "context"), ("by_depth", "needle depth")):
                        if r.get(col):
                            by = json.loads(r[col])
                            out.print(f"  {r['kv_dtype']}: accuracy by {what} " +
                                      ", ".join(f"{k}: {v * 100:.0f}%" for k, v in by.items()))
            out.print(f"results: {out_dir} (kind=eval summaries, kind=sample per-sample rows)")
        if any(r["status"] != "ok" for r in rows):
            raise typer.Exit(1)
