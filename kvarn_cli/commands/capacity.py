"""`kvarn capacity`: KV tokens per GPU for each format, as vLLM 0.26 would report them."""
from __future__ import annotations

import typer
from rich.table import Table

from kvarn.capacity import DEFAULT_OVERHEAD_GIB, H200_GIB, capacity as compute
from kvarn.formats import parse_formats
from kvarn.provenance import gpus
from kvarn.shapes import resolve_model

from ..console import out, print_json


def register(app: typer.Typer) -> None:
    @app.command("capacity")
    def capacity(
        model: str = typer.Option("qwen3-8b", "--model", "-m", help="Bundled name, local HF folder, or hub id."),
        tp: str = typer.Option("1", "--tp", "--tensor-parallel-size", metavar="N",
                               help="Tensor-parallel size (vLLM's --tensor-parallel-size)."),
        gpu_mem_gib: float = typer.Option(None, "--gpu-mem-gib",
                                          help=f"GPU memory in GiB (default: the visible GPU, else H200 {H200_GIB:.1f})."),
        gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
        weights_dtype: str = typer.Option(None, "--weights-dtype", help="Default: the model's torch_dtype."),
        context: int = typer.Option(16384, "--context", help="Tokens per request for max concurrency."),
        kv_dtype: str = typer.Option(None, "--kv-dtype", "--kv-cache-dtype", help="Comma list of kv dtypes (default: all)."),
        max_num_seqs: int = typer.Option(None, "--max-num-seqs",
                                         help="Requests the 16-bit tail buffers are reserved for (KVarN; default 256)."),
        overhead_gib: float = typer.Option(DEFAULT_OVERHEAD_GIB, "--overhead-gib",
                                           help="Non-KV memory besides weights (activations, graphs)."),
        json_: bool = typer.Option(False, "--json", help="One JSON object per format."),
    ) -> None:
        """KV capacity per GPU and ratio vs FP16 for each format (vLLM 0.26 page accounting)."""
        from kvarn.bench.parsing import parse_tp

        tp = parse_tp(tp)
        shape = resolve_model(model)
        shape.check_tp(tp)
        formats = parse_formats(kv_dtype)
        if gpu_mem_gib is None:
            g = gpus()
            gpu_mem_gib = g[0]["memory_gib"] if g else H200_GIB
        rows = [compute(shape, f, tp=tp, gpu_mem_gib=gpu_mem_gib, utilization=gpu_memory_utilization,
                        weights_dtype=weights_dtype, context=context, max_num_seqs=max_num_seqs,
                        overhead_gib=overhead_gib) for f in formats]
        if json_:
            for r in rows:
                print_json({"model": shape.name, "tp": tp, "gpu_mem_gib": gpu_mem_gib, **r.as_dict()})
            return
        t = Table(title=f"KV capacity: {shape.name}, TP={tp}, {gpu_mem_gib:.1f} GiB x {gpu_memory_utilization}")
        t.add_column("kv dtype", no_wrap=True)
        for col in ("B/token", "block", "KV tokens", "x fp16", f"reqs@{context}"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(r.kv_dtype, f"{r.bytes_per_token:,.0f}", str(r.block_size), f"{r.kv_tokens:,}",
                      f"{r.ratio_vs_fp16:.2f}x", f"{r.max_concurrency:.1f}" if r.max_concurrency is not None else "-")
        out.print(t)
        if any(r.fixed_bytes_per_request for r in rows):
            out.print("KVarN rows reserve a 16-bit unfinished-tile buffer for --max-num-seqs requests "
                      "from the same budget (max reqs is capped by it).")
