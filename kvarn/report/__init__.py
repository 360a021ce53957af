"""`kvarn report`: the accuracy-throughput-capacity frontier and every number behind it, from the results store.

Report and build_report load on first use: `kvarn gate` reads rows through kvarn.report.data and never draws, so it
does not import matplotlib."""
__all__ = ["Report", "build_report"]


def __getattr__(name: str):
    if name in __all__:
        from . import render

        return getattr(render, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
