"""`kvarn microbench {decode,store,prefill}`: time a KVarN kernel against the 16-bit baseline (logic in
kvarn.bench.microbench; this module only parses and prints)."""
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
        balance_iters: str = typer.Option(None, "--balance-iters",
                                          help="store: balancing iteration counts to time the flush at, side by "
                                               "side (e.g. 8,3; default: the format's own)."),
        graph_calls: int = typer.Option(None, "--graph-calls",
                                        help="decode: calls per captured CUDA graph (default 8; more = a longer "
                                             "burst, a loaded GPU's clocks)."),
        timing: str = typer.Option("in-turn", "--timing",
                                   help="decode: how ours and the baseline are timed: in-turn (A B A B), blocks "
                                        "(each's replays back to back, A B B A), gap (in turn, the GPU idle 20 ms "
                                        "before each) or all (each; the headline in turn)."),
    ) -> None:
        """Time the KVarN store / decode / prefill kernel and the FP16 baseline in the same run."""
        if target not in TARGET_NAMES:
            raise KvarnError(f"unknown microbench target {target!r}; accepted: {choices(TARGET_NAMES)}")
        # a flag of another target is not silently dropped (sizes are checked by kvarn.bench.microbench)
        only = {"--num-splits": ("decode", num_splits is not None), "--graph-calls": ("decode", graph_calls is not None),
                "--timing": ("decode", timing != "in-turn"), "--chunk": ("prefill", chunk is not None),
                "--model": ("store", model != "qwen3-8b"), "--balance-iters": ("store", balance_iters is not None)}
        for flag, (owner, given) in only.items():
            if given and target != owner:
                raise KvarnError(f"{flag} is a `microbench {owner}` option, not for {target}")
        counts = None
        if balance_iters is not None:
            try:
                counts = [int(x) for x in balance_iters.split(",") if x.strip()]
            except ValueError:
                counts = []
            if not counts:
                raise KvarnError(f"--balance-iters {balance_iters!r}: accepted is a comma list of counts in 1..64, "
                                 "e.g. 8,3")
        from kvarn.bench import microbench as bench

        dev = bench.resolve_device(device)
        d = bench.GPU_DEFAULTS if dev.type == "cuda" else bench.CPU_DEFAULTS
        pick = lambda v, k: d[k] if v is None else v  # noqa: E731
        args = dict(batch=pick(batch, "batch"), context=pick(context, "context"), q_heads=pick(q_heads, "q_heads"),
                    kv_heads=pick(kv_heads, "kv_heads"), head_dim=pick(head_dim, "head_dim"), kv_dtype=kv_dtype,
                    device=str(dev), check=check, iters=iters)
        if target == "decode":
            r = bench.bench_decode(**args, num_splits=num_splits, graph_calls=graph_calls, timing=timing)
        elif target == "prefill":
            r = bench.bench_prefill(**args, chunk=chunk)
        else:
            r = bench.bench_store(**args, model=model, balance_iters=counts)
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
        if k == "orders" and v:  # --timing all: the same pair timed in each order
            for o, m in v.items():
                ratio = "-" if m["ratio"] is None else f"{m['ratio']:.3f}x"
                mhz = f" (SM {m['sm_mhz']} / {m['baseline_sm_mhz']} MHz)" if m.get("sm_mhz") else ""
                t.add_row(f"timed {o}: ours / baseline ms", f"{m['ms']:.4f} / {m['baseline_ms']:.4f} = {ratio}{mhz}")
        elif k == "flush_ms_by_iters" and v:  # --balance-iters
            t.add_row("flush x layers by balancing iterations (ms)",
                      ", ".join(f"{n}: {ms:.4f}" for n, ms in v.items()))
        elif v is not None:
            t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    out.print(t)
    if r.interpreter:
        out.print("CPU: kernels ran through the Triton interpreter at small sizes; times are not performance.")
