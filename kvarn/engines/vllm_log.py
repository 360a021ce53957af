"""Reading a vLLM engine's log: why it stopped (out of memory or another error) and which lines belong to the
latest attempt (a cell's log is appended to by each rerun, after a `$ command` header)."""
from __future__ import annotations

import re
import sys

OOM_PATTERNS = ("CUDA out of memory", "OutOfMemoryError", "out of memory", "No available memory for the cache blocks",
                "larger than the available KV cache memory", "Insufficient memory")
BURST_MARK = "[kvarn] the timed burst starts"  # in the cell log: what compiles after it, compiled under load


def classify_error(text: str) -> str:
    return "oom" if any(p.lower() in text.lower() for p in OOM_PATTERNS) else "failed"


def latest_attempt(log_text: str) -> list[str]:
    """The non-empty lines (stripped) of a cell log's latest attempt: each rerun appends after a `$ command` header."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    heads = [i for i, ln in enumerate(lines) if ln.startswith("$ ")]
    return lines[heads[-1] + 1:] if heads else lines


def last_error_line(log_text: str) -> str:
    """The line of an engine's log that says why it stopped: the last out-of-memory line, else the last exception
    line (not the traceback's frames), else the last line; of the latest attempt only."""
    lines = latest_attempt(log_text)
    for pick in (lambda x: classify_error(x) == "oom",
                 lambda x: re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", x) or "Error:" in x or "error:" in x):
        hit = [x for x in lines if pick(x)]
        if hit:
            return hit[-1][:500]
    return lines[-1][:500] if lines else "worker exited without output"


def log_file_error(path: str | None, tail_bytes: int = 200_000) -> str:
    """last_error_line of the end of a log file this process writes to (a server's, sharing our stdout)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            return last_error_line(f.read().decode(errors="replace"))[:300]  # within the row's 500
    except (OSError, TypeError):
        return "(no log)"
