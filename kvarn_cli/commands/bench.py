"""`kvarn bench`: run vLLM (or transformers) across KV formats, bursts and TP sizes; one Parquet row per cell."""
from __future__ import annotations

from typing import List, Optional

import typer

from ..console import err, out


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        model: Optional[str] = typer.Option(None, "--model", "-m", help="Bundled shape (qwen3-8b...), local HF folder or hub "
                                            "id. Default: smollm2-135m (SmolLM2-135M-Instruct, runs on a CPU)."),
        kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", "--kv-cache-dtype", help="Comma list of KV "
                                               "formats, or 'all'. Default: vllm auto, fp8, kvarn_k4v2_g128, "
                                               "turboquant_4bit_nc, turboquant_k3v4_nc; hf auto, fp8, kvarn_k4v2_g128 "
                                               "(TurboQuant takes minutes per cell on a CPU). FP16 cells run first "
                                               "(the ratios' baseline), the rest in this order."),
        burst: Optional[str] = typer.Option(None, "--burst", "-b", help="Context per request (prompt + output): 4k, "
                                            "16k, 32768; comma list. Default: hf 544 (512+32), vllm 4k."),
        requests: Optional[int] = typer.Option(None, "--requests", "--num-prompts", "-n", help="Requests per "
                                               "burst, all submitted at once offline. Default: hf 2, vllm 64."),
        prompt_len: Optional[str] = typer.Option(None, "--prompt-len", "--input-len",
                                                 help="Prompt tokens (default: burst / 8)."),
        output_len: Optional[str] = typer.Option(None, "--output-len", help="Generated tokens (default: the rest of "
                                                 "the burst: a short prompt and a long, reasoning-like generation)."),
        tp: str = typer.Option("1", "--tp", "--tensor-parallel-size", metavar="N[,N]", help="Tensor-parallel size "
                               "(vLLM's --tensor-parallel-size); a comma list (1,2) runs each."),
        dummy_weights: Optional[bool] = typer.Option(None, "--dummy-weights/--real-weights", help="Random weights "
                                                     "with the real shapes (no download). Default: on when no weights "
                                                     "are found locally."),
        weights: Optional[str] = typer.Option(None, "--weights", help="Real weights for the shape: a local folder "
                                              "or a hub id in the local HF cache (smollm2-135m on hf)."),
        dtype: Optional[str] = typer.Option(None, "--dtype", metavar="auto|float16|bfloat16|float32",
                                            help="Model dtype, passed to vLLM as dtype= and to transformers (auto: "
                                            "the model config's). Default: the model's; fp8 KV runs bfloat16 on "
                                            "vLLM; float32 on a CPU."),
        gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
        max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="vLLM's running-request cap; the "
                                                   "hf engine's batch size (default: all requests)."),
        repeat: int = typer.Option(1, "--repeat", "--repeats", help="Runs per configuration (odd for medians)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the prompt token ids and of vLLM."),
        out_dir: str = typer.Option("results", "--out", "-o", help="Results directory (Parquet parts + logs/)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan table; run and write nothing."),
        mode: str = typer.Option("offline", "--mode", help="offline: LLM engine, burst at once (alias throughput); "
                                 "serve: `vllm serve` + streamed /v1/completions, vllm bench serve metrics."),
        engine: str = typer.Option("auto", "--engine", help="auto (vllm with vLLM + a GPU, else hf), vllm, hf."),
        timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds per configuration x repeat "
                                                "(default: vllm 1800, the first TurboQuant start compiles; hf 900)."),
        force: bool = typer.Option(False, "--force", help="Redo cells that already have an ok row."),
        resume: bool = typer.Option(True, "--resume/--no-resume", hidden=True,
                                    help="Skip finished cells (the default; --force redoes them)."),
        request_rate: Optional[float] = typer.Option(None, "--request-rate", help="serve: requests/s (default inf: "
                                                     "all at once)."),
        burstiness: Optional[float] = typer.Option(None, "--burstiness", help="serve: gamma shape of arrivals "
                                                   "(1 = Poisson, <1 burstier)."),
        max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="serve: requests in flight."),
        goodput: Optional[List[str]] = typer.Option(None, "--goodput", help="serve: SLOs in ms, e.g. "
                                                    "'ttft:500 tpot:50 e2el:20000' (repeatable)."),
        engine_arg: Optional[List[str]] = typer.Option(None, "--engine-arg", "-E", help="Extra vLLM engine argument "
                                                       "key=value (repeatable), e.g. enforce_eager=true."),
        baseline_run: Optional[str] = typer.Option(None, "--baseline-run", metavar="RUN_ID", help="Take the ratios "
                                                   "against the FP16 rows of this earlier run in OUT (same GPU) "
                                                   "instead of this run's own; such ratios are labelled cross-run."),
        pair_fp16: bool = typer.Option(False, "--pair-fp16", help="Rerun a setting's FP16 cell in this run whenever "
                                       "one of its candidates runs (a resumed candidate never pairs with an earlier "
                                       "call's FP16 row; an unpaired stored candidate runs again)."),
        distributed_executor_backend: Optional[str] = typer.Option(
            None, "--distributed-executor-backend", help="vLLM executor: mp (one host) or ray (multi-node: start a "
            "Ray cluster first, then run kvarn bench on its head node)."),
    ) -> None:
        """Benchmark KV formats x bursts x TP; one row per configuration x repeat in OUT (Parquet), resumable.

        Example: kvarn bench --model Qwen/Qwen3-32B --tp 2 --burst 16k

        Exit status: 0 every cell ok; 1 some cell failed, timed out or ran out of memory (the others still ran; its
        row holds the error); 2 bad input (nothing written); 130 interrupted.
        """
        from kvarn.bench.plan import BenchOptions, build_plan
        from kvarn.bench.view import plan_table

        args = list(engine_arg or [])
        if distributed_executor_backend:
            args.append(f"distributed_executor_backend={distributed_executor_backend}")
        opts = BenchOptions(model=model, kv_dtype=kv_dtype, burst=burst, requests=requests, prompt_len=prompt_len,
                            output_len=output_len, tp=tp, dummy_weights=dummy_weights, weights=weights, dtype=dtype,
                            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs, repeat=repeat,
                            seed=seed, out=out_dir, mode=mode, engine=engine, timeout=timeout, force=force,
                            request_rate=request_rate, burstiness=burstiness, max_concurrency=max_concurrency,
                            goodput=goodput, engine_args=args, baseline_run=baseline_run, pair_fp16=pair_fp16)
        plan = build_plan(opts)
        out.print(f"engine: [bold]{plan.engine.name}[/] ({plan.engine_reason}); model {plan.shape.name} "
                  f"({'dummy weights' if plan.configs[0].dummy_weights else 'real weights'}); "
                  f"timeout {plan.timeout_s:.0f} s per cell")
        for note in plan.notes:
            out.print(f"note: {note}")
        if dry_run:
            out.print(plan_table(plan))
            out.print("dry run: nothing was run or written")
            return
        _run(plan)

    def _run(plan) -> None:
        from kvarn.bench.runner import run_plan
        from kvarn.bench.view import LiveView, stall_notes, start_notes, summary_table
        from kvarn.results import ResultsStore

        if not plan.todo:
            out.print(f"all {len(plan.cells)} cells already have an ok row in {plan.out} (use --force to redo)")
        else:
            if plan.done:
                out.print(f"resuming: {plan.done} of {len(plan.cells)} cells already done in {plan.out}")
            try:
                with LiveView(out, plan) as view:
                    run_plan(plan, view)
            except KeyboardInterrupt:
                err("interrupted: the cell in flight was stopped and not written; rerun to resume")
                raise typer.Exit(130)
        stored = ResultsStore(plan.out).read("bench")
        wanted = {(c.hash, c.repeat) for c in plan.cells}
        rows = [r for r in stored.to_dict("records") if (r["config_hash"], int(r["repeat"])) in wanted]
        latest: dict = {}
        for r in sorted(rows, key=lambda r: (r["status"] == "ok", str(r.get("created_at")))):
            latest[(r["config_hash"], int(r["repeat"]))] = r  # an ok row wins over an older failure
        order = {(c.hash, c.repeat): i for i, c in enumerate(plan.cells)}
        final = sorted(latest.values(), key=lambda r: order[(r["config_hash"], int(r["repeat"]))])
        out.print(summary_table(final, width=out.width, baseline_run=plan.baseline_run))
        for note in stall_notes(final) + start_notes(final):
            out.print(note, markup=False)
        bad = [r for r in final if r["status"] != "ok"]
        out.print(f"{len(final) - len(bad)} ok, {len(bad)} not ok; rows in {plan.out}/parts, "
                  f"engine logs in {plan.out}/logs; `kvarn results {plan.out}` lists them")
        if bad:  # as `kvarn eval`: scripts and CI see a failed / timed-out / OOM cell (its row says why)
            raise typer.Exit(1)
