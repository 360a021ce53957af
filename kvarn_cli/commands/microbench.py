"""`kvarn microbench {decode,store,prefill}`: time a KVarN kernel against the 16-bit baseline (logic in
kvarn.kernels.bench; this module only parses and prints)."""
from __future__ import annotations

import typer
from rich.table import Table

from kvarn.errors import KvarnError, choices
from kvarn.formats import DEFAULT_KVARN

from ..console import out, print_json

TARGET_NAMES = ("decode", "store", "prefill")


def register(app: typer.Typer) -> None:
    @app.command("microbench")
    def microbench(
        target: str = typer.Argument("decode", help=f"What to time: {choices(TARGET_NAMES)}."),
        batch: int = typer.Option(None, "--batch", help="Requests (GPU default 64, CPU 2)."),
        context: int = typer.Option(None, "--context", help="Tokens per request (GPU default 16384, CPU 200)."),
        q_heads: int = typer.Option(None, "--q-heads", help="Query heads (GPU default 32, CPU 4)."),
        kv_heads: int = typer.Option(None, "--kv-heads", help="KV heads (GPU default 8, CPU 2)."),
        head_dim: int = typer.Option(None, "--head-dim", help="64, 128 or 256 (GPU default 128, CPU 64)."),
        kv_dtype: str = typer.Option(DEFAULT_KVARN, "--kv-dtype", "--kv-cache-dtype", help="A kvarn_* preset."),
        device: str = typer.Option("auto", "--device", help="auto, cuda[:N] or cpu (Triton interpreter)."),
        check: bool = typer.Option(False, "--check", help="Also compare with the PyTorch reference (rel. error)."),
        json_: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
        iters: int = typer.Option(None, "--iters", help="Timed runs (median; GPU default 50, CPU 2)."),
        num_splits: int = typer.Option(None, "--num-splits", help="decode: context splits (default: heuristic)."),
        chunk: int = typer.Option(None, "--chunk", help="prefill: query tokens per request (GPU 512, CPU 16)."),
        model: str = typer.Option("qwen3-8b", "--model", help="store: the model whose layer count a flush spans."),
        sweep: bool = typer.Option(False, "--sweep", help="decode: also time every kernel config (table; with "
                                                         "--check each is checked) and split counts for the best."),
        breakdown: bool = typer.Option(False, "--breakdown", help="decode: also time each of the call's launches "
                                                                  "(rotate, records, tail, merge) alone."),
        graph_calls: int = typer.Option(None, "--graph-calls",
                                        help="decode: calls per captured CUDA graph (default 8; more = a longer "
                                             "burst, a loaded GPU's clocks)."),
        timing: str = typer.Option("in-turn", "--timing",
                                   help="decode: how ours and the baseline are timed: in-turn (A B A B), blocks "
                                        "(each's replays back to back, A B B A), gap (in turn, the GPU idle 20 ms "
                                        "before each) or all (each; the headline in turn)."),
        config: str = typer.Option(None, "--config",
                                   help="decode: time this kernel config (a name from the --sweep table, e.g. "
                                        "u2k3v1w2s5x1n8L2p2t1g1) instead of the default."),
    ) -> None:
        """Time the KVarN store / decode / prefill kernel and the FP16 baseline in the same run."""
        if target not in TARGET_NAMES:
            raise KvarnError(f"unknown microbench target {target!r}; accepted: {choices(TARGET_NAMES)}")
        # a flag of another target is not silently dropped (sizes are checked by kvarn.kernels.bench)
        only = {"--num-splits": ("decode", num_splits is not None), "--sweep": ("decode", sweep),
                "--breakdown": ("decode", breakdown), "--graph-calls": ("decode", graph_calls is not None),
                "--timing": ("decode", timing != "in-turn"), "--config": ("decode", config is not None),
                "--chunk": ("prefill", chunk is not None), "--model": ("store", model != "qwen3-8b")}
        for flag, (owner, given) in only.items():
            if given and target != owner:
                raise KvarnError(f"{flag} is a `microbench {owner}` option, not for {target}")
        from kvarn.kernels import bench

        dev = bench.resolve_device(device)
        d = bench.GPU_DEFAULTS if dev.type == "cuda" else bench.CPU_DEFAULTS
        pick = lambda v, k: d[k] if v is None else v  # noqa: E731
        args = dict(batch=pick(batch, "batch"), context=pick(context, "context"), q_heads=pick(q_heads, "q_heads"),
                    kv_heads=pick(kv_heads, "kv_heads"), head_dim=pick(head_dim, "head_dim"), kv_dtype=kv_dtype,
                    device=str(dev), check=check, iters=iters)
        if target == "decode":
            r = bench.bench_decode(**args, num_splits=num_splits, sweep=sweep, breakdown=breakdown,
                                   graph_calls=graph_calls, timing=timing, config=config)
        elif target == "prefill":
            r = bench.bench_prefill(**args, chunk=chunk)
        else:
            r = bench.bench_store(**args, model=model)
        if json_:
            print_json(r.as_dict())
            return
        _print(r)


def _print(r) -> None:
    t = Table(title=f"kvarn microbench {r.kernel}: {r.kv_dtype}, B={r.batch}, context={r.context}, "
                    f"Hq={r.q_heads}, Hk={r.kv_heads}, D={r.head_dim}, {r.device}")
    t.add_column("what", no_wrap=True)
    t.add_column("value", justify="right")
    ours = "store flush x layers" if r.kernel == "store" else f"kvarn {r.kernel}"
    t.add_row(f"{ours} (median ms)", f"{r.ms:.4f}")
    t.add_row(f"baseline: {r.baseline} (ms)", "-" if r.baseline_ms is None else f"{r.baseline_ms:.4f}")
    t.add_row("ratio ours / baseline", "-" if r.ratio is None else f"{r.ratio:.3f}x")
    t.add_row("bytes moved (packed)", f"{r.bytes:,}")
    t.add_row("achieved GB/s / copy GB/s", f"{r.gbps:,.1f} / {r.copy_gbps:,.1f} ({100 * r.bw_frac:.1f}%)")
    if r.rel_err is not None:
        t.add_row("rel. error vs reference", f"{r.rel_err:.2e}")
    for k, v in r.extra.items():
        if k == "breakdown" and v:  # each launch alone, the graph launch's share, the whole call, the gaps
            t.add_row("breakdown (ms)", ", ".join(f"{n} {ms:.4f}" for n, ms in v.items()))
        elif k == "orders" and v:  # --timing all: the same pair timed in each order
            for o, m in v.items():
                ratio = "-" if m["ratio"] is None else f"{m['ratio']:.3f}x"
                mhz = f" (SM {m['sm_mhz']} / {m['baseline_sm_mhz']} MHz)" if m.get("sm_mhz") else ""
                t.add_row(f"timed {o}: ours / baseline ms", f"{m['ms']:.4f} / {m['baseline_ms']:.4f} = {ratio}{mhz}")
        elif v is not None and k not in ("sweep", "variants"):
            t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    out.print(t)
    if r.extra.get("sweep"):
        s = Table(title="decode config sweep (u: unpack 0 cast/1 exponent trick/2 PTX; k/v: fp16 split; w warps; "
                        "s stages; r register cap)")
        for c in ("config", "splits", "ms", "x default", "GB/s", "rel err", "first call s", "error"):
            s.add_column(c, justify="left" if c in ("config", "error") else "right")
        for row in r.extra["sweep"]:
            splits = str(row.get("splits") or "auto") + ("*" if row.get("again") else "")  # *: re-timed last
            s.add_row(row["config"], splits, f"{row['ms']:.4f}" if "ms" in row else "-",
                      f"{row['vs_default']:.3f}" if "vs_default" in row else "-",  # timed in turn with it
                      f"{row['gbps']:.0f}" if "gbps" in row else "-",
                      f"{row['rel_err']:.1e}" if "rel_err" in row else "-",
                      f"{row['first_call_s']:.1f}" if "first_call_s" in row else "-", row.get("error", ""))
        out.print(s)
    if r.extra.get("variants"):
        cols = ("flush_ms", "flush_host_ms", "batch_flush_ms", "decode_idle_ms", "decode_one_ms", "rel_err")
        s = Table(title="store variants (ms per decode step of all layers, CUDA-graph replay on a GPU; host: call by "
                        "call with the launch; decode: store_decode, no row / one row completing a tile)")
        for c in ("balance", "decode grid", *cols, "error"):
            s.add_column(c, justify="left" if c in ("balance", "decode grid", "error") else "right")
        for row in r.extra["variants"]:
            s.add_row(row["balance"], row["decode_grid"], *(f"{row[c]:.4g}" if c in row else "-" for c in cols),
                      row.get("error", ""))
        out.print(s)
    if r.interpreter:
        out.print("CPU: kernels ran through the Triton interpreter at small sizes; times are not performance.")
