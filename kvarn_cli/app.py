"""`kvarn`: the Typer app. Each command lives in kvarn_cli/commands/<name>.py and registers itself here."""
from __future__ import annotations

import sys

import typer

from kvarn.errors import KvarnError

try:
    from .commands import bench, capacity, data, env, eval as eval_cmd, fidelity, gate, microbench, profile, report, results, suite
except KvarnError as _e:  # a bad KVARN_* setting, read as the formats load: one line, exit 2
    print(f"error: {_e}", file=sys.stderr)
    raise SystemExit(_e.exit_code) from None
from .console import err

app = typer.Typer(
    name="kvarn",
    help="KVarN KV-cache quantization for vLLM: capacity, benchmarks, accuracy, reports and regression gates.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

for module in (capacity, env, bench, eval_cmd, fidelity, microbench, profile, report, gate, suite, results, data):
    module.register(app)


def _version(value: bool) -> None:
    if value:
        from kvarn import __version__

        print(f"kvarn {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print kvarn's version and exit.")) -> None:
    """KVarN KV-cache quantization for vLLM: capacity, benchmarks, accuracy, reports and regression gates."""


def _flags_without_type() -> None:
    """Typer's help prints a value type beside every option, `<bool>` beside flags too, which reads as if a flag
    took a value (`--json true`). A flag takes none: it gets no type column."""
    from typer import core

    cls = getattr(core, "TyperOption", None)
    show = getattr(cls, "display_type_rich", None)
    if show is None or getattr(show, "_kvarn_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) else show(self, ctx)

    display_type_rich._kvarn_flags = True
    cls.display_type_rich = display_type_rich


_flags_without_type()


def main(argv: list[str] | None = None) -> int:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        rv = app(args=argv, prog_name="kvarn", standalone_mode=False)
        if isinstance(rv, int) and not isinstance(rv, bool):  # click returns typer.Exit(code) in this mode
            return rv
    except KvarnError as e:
        err(f"error: {e}")
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:  # click's own exits (--help, usage errors already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except (typer.Abort, KeyboardInterrupt):
        err("aborted")
        return 130
    except Exception as e:  # click usage errors (unknown option, bad value) in non-standalone mode
        if isinstance(e, _click_exceptions()):
            e.show(file=sys.stderr)
            return e.exit_code
        raise
    return 0


def _click_exceptions() -> tuple[type, ...]:
    """ClickException of click and of the copy newer Typer releases vendor as typer._click (distinct classes)."""
    import importlib

    found = []
    for mod in ("click.exceptions", "typer._click.exceptions"):
        try:
            found.append(importlib.import_module(mod).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


if __name__ == "__main__":
    sys.exit(main())
