"""`kvarn profile`: where a decode (or prefill) step's time goes, per category, next to its floor (logic in
kvarn.bench.profile; this module only parses and prints)."""
from __future__ import annotations

from typing import List, Optional

import typer
from rich.table import Table

from kvarn.errors import KvarnError
from kvarn.formats import DEFAULT_KVARN

from ..console import err, out, print_json


def register(app: typer.Typer) -> None:
    @app.command("profile")
    def profile_cmd(
        model: str = typer.Option("qwen3-8b", "--model", "-m", help="Bundled name, local HF folder, or hub id "
                                                                     "(dummy weights)."),
        kv_dtype: str = typer.Option(f"auto,{DEFAULT_KVARN}", "--kv-dtype", "--kv-cache-dtype",
                                     help="Comma list; each runs in its own engine process, one after another."),
        batch: int = typer.Option(64, "--batch", help="Requests decoding together."),
        context: int = typer.Option(4096, "--context", help="Prompt tokens per request (prefilled first)."),
        steps: int = typer.Option(20, "--steps", help="Decode steps profiled (decode phase)."),
        phase: str = typer.Option("decode", "--phase", help="decode: N decode steps at context C; prefill: every "
                                                            "step of the fill, until all B requests have a token."),
        stagger: bool = typer.Option(True, "--stagger/--no-stagger",
                                     help="Spread prompt lengths over one 128-token tile so tile flushes are "
                                          "amortised as in serving (else all flush on the same step)."),
        json_: bool = typer.Option(False, "--json", help="One JSON object per dtype instead of tables."),
        trace: str = typer.Option(None, "--trace", help="Folder for a chrome trace per dtype (trace-DTYPE.json)."),
        workdir: str = typer.Option(None, "--workdir", help="Folder for specs, results and worker logs."),
        timeout: float = typer.Option(600, "--timeout", help="Seconds per engine process."),
        gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
        engine_arg: Optional[List[str]] = typer.Option(None, "--engine-arg", "-E", help="Extra vLLM engine argument "
                                                       "key=value (repeatable), e.g. max_num_batched_tokens=8192 for "
                                                       "`vllm serve`'s step budget."),
    ) -> None:
        """Profile N decode steps, or the prefill, (torch.profiler + CUDA events) of a fresh vLLM engine at batch B,
        context C."""
        from kvarn.bench.profile import profile

        kinds = [k.strip() for k in kv_dtype.split(",") if k.strip()]
        if not kinds:
            raise KvarnError("--kv-dtype is empty")
        results = profile(model, kinds, batch, context, steps, trace_dir=trace, workdir=workdir, timeout_s=timeout,
                          stagger=stagger, gpu_memory_utilization=gpu_memory_utilization, phase=phase, log=err,
                          engine_args=list(engine_arg or []))
        if json_:
            for r in results:
                print_json(r)
        else:
            for r in results:
                _print_one(r)
            if len([r for r in results if r.get("status") == "ok"]) > 1:
                _print_compare(results)
        if any(r.get("status") != "ok" for r in results):
            raise typer.Exit(1)


def _f(v, fmt="{:.3f}"):
    return "-" if v is None else fmt.format(v)


def _print_one(r: dict) -> None:
    if r.get("status") != "ok":
        out.print(f"{r.get('kv_dtype')}: {r.get('status')}: {r.get('error')} (log {r.get('log')})")
        return
    fl = r["floors"]
    phase = r.get("phase", "decode")
    if phase == "prefill":
        what = (f"the prefill, {r['steps']} steps; floor = GEMM and attention FLOPs / {fl['peak_flops'] / 1e12:.0f} "
                f"TFLOP/s, KV writes / {fl['bandwidth_bytes_per_s'] / 1e12:.1f} TB/s")
    else:
        what = f"{r['steps']} decode steps; floor = bytes / {fl['bandwidth_bytes_per_s'] / 1e12:.1f} TB/s"
    t = Table(title=f"kvarn profile: {r['kv_dtype']}, {r['model']}, B={r['batch']}, C={r['context']} "
                    f"(mean ctx {r['mean_ctx']:.0f}), {what}")
    for c in ("category", "ms/step", "share", "floor ms", "x floor"):
        t.add_column(c, justify="left" if c == "category" else "right", no_wrap=c == "category")
    for row in r["rows"]:
        t.add_row(row["category"], f"{row['ms']:.3f}", _f(row["share"], "{:.1%}"), _f(row["floor_ms"]),
                  _f(row["x_floor"], "{:.1f}x"))
    out.print(t)
    common = (f"tiles flushed/step {fl['tiles_per_step']:.1f}; {r['trace']['kernels'] / r['steps']:.0f} kernels/step; "
              f"start {r['engine_start_s']:.0f} s")
    if phase == "prefill":
        warm = r.get("warm_fill_s")
        out.print(f"{fl['tokens']:,} prompt tokens in {r['steps']} steps: every request's first token after "
                  f"{r['fill_s']:.3f} s (profiled; the warm-up fill before it {_f(warm, '{:.3f}')} s, unprofiled); "
                  f"{common}")
    else:
        kv = fl["kv_read"]
        out.print(f"KV read/step: {kv['total'] / 1e9:.2f} GB ({kv['packed'] / 1e9:.2f} packed + "
                  f"{kv['tail'] / 1e9:.2f} 16-bit tail), FP16 equivalent {kv['fp16_equivalent'] / 1e9:.2f} GB; "
                  f"weights {fl['weights'] / 1e9:.2f} GB; {common}, prefill {r['fill_s']:.1f} s")
    top = r["trace"]["top"][:8]
    if top:
        out.print("top kernels (ms/step, calls/step): " + "; ".join(
            f"{k['name'][:60]} [{k['category']}] {k['us'] / 1e3 / r['steps']:.3f} ({k['count'] / r['steps']:.0f})"
            for k in top))


def _print_compare(results: list[dict]) -> None:
    ok = [r for r in results if r.get("status") == "ok"]
    base = next((r for r in ok if r["kv_dtype"] in ("auto", "float16", "bfloat16")), ok[0])
    t = Table(title=f"{base.get('phase', 'decode')} step by category, ms/step (ratio vs {base['kv_dtype']})")
    t.add_column("category", no_wrap=True)
    for r in ok:
        t.add_column(r["kv_dtype"], justify="right")
    keys: list[tuple[str, str]] = []
    for r in ok:
        for row in r["rows"]:
            if (row["key"], row["category"]) not in keys:
                keys.append((row["key"], row["category"]))
    for key, label in keys:
        b = next((x["ms"] for x in base["rows"] if x["key"] == key), None)
        cells = []
        for r in ok:
            v = next((x["ms"] for x in r["rows"] if x["key"] == key), None)
            if v is None:
                cells.append("-")
            elif r is base or not b:
                cells.append(f"{v:.3f}")
            else:
                cells.append(f"{v:.3f} ({v / b:.2f}x)")
        t.add_row(label, *cells)
    out.print(t)
