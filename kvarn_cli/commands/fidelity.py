"""`kvarn fidelity`: K/V, attention and perplexity damage of each KV format (logic in kvarn.method.fidelity)."""
from __future__ import annotations

import math

import typer
from rich.table import Table

from ..console import err, out, print_json


def _f(x, fmt="{:.4f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def register(app: typer.Typer) -> None:
    @app.command("fidelity")
    def fidelity(
        model: str = typer.Option("synthetic", "--model", "-m",
                                  help="'synthetic' (no model, seeded K/V), 'smollm2-135m', or a local HF folder."),
        kv_dtype: str = typer.Option(None, "--kv-dtype", "--kv-cache-dtype",
                                     help="Comma list of kv dtypes or ablations (e.g. kvarn_k4v2_g128-nobal); "
                                          "default: auto, fp8, the 4 TurboQuant and the 4 KVarN presets; 'all'."),
        context: int = typer.Option(None, "--context", help="Tokens per window (default 4096; synthetic 1024)."),
        chunk: int = typer.Option(128, "--chunk", help="Tokens per forward in the chunked perplexity."),
        text: str = typer.Option(None, "--text", help="UTF-8 text file (default: the shipped Moby-Dick excerpt)."),
        start_char: int = typer.Option(None, "--start-char",
                                       help="Skip this many characters of the text (default 20000 for the "
                                            "shipped excerpt, 0 for --text)."),
        windows: int = typer.Option(1, "--windows", help="Consecutive windows of --context tokens for perplexity."),
        device: str = typer.Option("cpu", "--device", help="torch device of the model or the synthetic K/V: cpu, "
                                                               "cuda, cuda:N, mps (where torch has it)."),
        dtype: str = typer.Option(None, "--dtype", metavar="auto|float16|bfloat16|float32",
                                  help="Model dtype (auto: the model config's, as vLLM; default: transformers' "
                                       "choice, float32 for the shipped SmolLM2)."),
        sink: int = typer.Option(None, "--sink", help="First N tokens kept 16-bit in the cache (default: each "
                                                      "format's own: 16 for KVarN presets, 0 for the others)."),
        per_layer: bool = typer.Option(False, "--per-layer", help="Also show / emit the per-layer K/V metrics."),
        json_: bool = typer.Option(False, "--json", help="One JSON object per format."),
        out_dir: str = typer.Option(None, "--out", help="Also append rows (kind=fidelity) to this results store."),
    ) -> None:
        """Key/value relative MSE, attention-output error and score KL per format; with a real model also chunked
        perplexity through a quantized transformers cache, its change vs fp16, next-token KL and top-1 agreement."""
        from kvarn.method.fidelity import run_fidelity

        log = lambda m: err(m)  # noqa: E731  progress goes to stderr, JSON to stdout
        results, info = run_fidelity(model=model, kv_dtypes=kv_dtype, context=context, chunk=chunk, text=text,
                                     device=device, sink=sink, windows=windows, start_char=start_char, log=log,
                                     dtype=dtype)
        if out_dir:
            _store(out_dir, results, info)
        if json_:
            for r in results:
                print_json({**{k: info.get(k) for k in ("model", "context", "chunk", "sink", "windows", "layers",
                                                        "dtype")},
                            **r.as_dict(per_layer)})
            return
        has_ppl = "ppl" in results[0].metrics
        t = Table(title=f"KV fidelity: {info['model']}, {info['context']} tokens x {info['windows'] if has_ppl else 1}"
                        f", {info['layers']} layers"
                        + (f", chunk {info['chunk']}, {info['dtype']}" if has_ppl else ""))
        t.add_column("kv dtype", no_wrap=True)
        cols = ["B/tok/head", "K rel MSE", "V rel MSE", "attn out err", "score KL"]
        if has_ppl:
            cols += ["ppl", "Δppl %", "next-tok KL", "top-1"]
        for c in cols:
            t.add_column(c, justify="right")
        for r in results:
            m = r.metrics
            row = [r.kv_dtype, f"{r.bytes_per_token_per_head:.0f}", _f(m["k_rel_mse"]), _f(m["v_rel_mse"]),
                   _f(m["out_rel_err"]), _f(m["score_kl"])]
            if has_ppl:
                row += [_f(m["ppl"], "{:.2f}"), _f(m["ppl_delta_pct"], "{:+.2f}"), _f(m["next_token_kl"]),
                        _f(m["top1_agree"], "{:.3f}")]
            t.add_row(*row)
        out.print(t)
        if per_layer:
            lt = Table(title="per layer (16 = layer kept 16-bit by the format)")
            for c in ("kv dtype", "layer", "K rel MSE", "V rel MSE", "attn out err", "score KL"):
                lt.add_column(c, justify="left" if c == "kv dtype" else "right")
            for r in results:
                for x in r.layers:
                    lt.add_row(r.kv_dtype, f"{x['layer']}" + (" (16)" if x["sixteen_bit"] else ""),
                               _f(x["k_rel_mse"]), _f(x["v_rel_mse"]), _f(x["out_rel_err"]), _f(x["score_kl"]))
            out.print(lt)
        out.print(f"[dim]{info['seconds']} s[/dim]")


def _store(out_dir: str, results, info: dict) -> None:
    import json

    from kvarn.method.codecs import get_codec
    from kvarn.results import ResultsStore
    from kvarn.results.schema import config_hash

    rows = []
    for r in results:
        cfg = {k: info.get(k) for k in ("model", "context", "chunk", "sink", "windows", "text", "start_char")}
        if info.get("dtype") not in (None, "float32"):  # hashed when not the float32 every earlier row ran in
            cfg["dtype"] = info["dtype"]
        cfg["kv_dtype"] = r.kv_dtype
        rows.append({"kind": "fidelity", "status": "ok", "config_hash": config_hash(cfg), "run_id": _run_id(),
                     "model": info["model"], "kv_dtype": r.kv_dtype, "engine": "hf", "tp": 1, "seed": 0,
                     "context": info["context"], "chunk": info["chunk"],
                     "sink": info["sink"] if info["sink"] is not None else get_codec(r.kv_dtype).fmt.sink_tokens,
                     "windows": info["windows"], "layers": info["layers"], "model_dtype": info.get("dtype"),
                     "bytes_per_token_per_head": r.bytes_per_token_per_head, **r.metrics,
                     "per_layer_json": json.dumps(r.layers)})
    ResultsStore(out_dir).append(rows, kind="fidelity")


_RUN = None


def _run_id() -> str:
    global _RUN
    if _RUN is None:
        from kvarn.results.schema import new_row_id

        _RUN = new_row_id()
    return _RUN
