"""`kvarn report`: the accuracy-throughput-capacity frontier and every number behind it, from the results store."""
from .render import Report, build_report

__all__ = ["Report", "build_report"]
