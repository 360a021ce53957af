"""Append-only, atomic Parquet store: one file per append under DIR/parts/, read back as one table.

Each append writes `parts/<kind>-<time>-<id>.parquet.tmp` then renames it: a crash never leaves half a file and
never touches earlier results. Readers concatenate all parts (schemas may grow: missing columns become null).
"""
from __future__ import annotations

import datetime as _dt
import os
import sys
import uuid
from pathlib import Path

import pandas as pd

from ..errors import KvarnError
from ..provenance import provenance
from .schema import COLUMN_TYPES, CORE_COLUMNS, PROVENANCE_COLUMNS, SCHEMA_VERSION, STATUSES, new_row_id

_WARNED: set = set()  # unreadable parts already reported in this process


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    """Cast the schema's columns to their declared types (ints with nulls fall back to float64). A value that does
    not fit its type leaves that column as it is: a row is never lost to its own typing."""
    for col, dtype in COLUMN_TYPES.items():
        if col not in df.columns:
            continue
        s = df[col]
        try:
            if dtype == "float64" or (dtype == "int64" and s.isna().any()):
                df[col] = pd.to_numeric(s, errors="raise").astype("float64")
            else:
                df[col] = s.astype(dtype)
        except (TypeError, ValueError):
            pass
    return df


def _write_atomic(df: pd.DataFrame, path: Path) -> None:
    """Write to path.tmp, flush it to disk, rename: a crash leaves the old state or the whole new file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        df.to_parquet(f, index=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX
    try:  # the rename itself survives a power loss once the directory entry is on disk
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class ResultsStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.parts = self.root / "parts"

    # ---- write -------------------------------------------------------------------------------
    def complete_row(self, row: dict) -> dict:
        """Fill schema_version, row_id, created_at and provenance; check status."""
        r = dict(row)
        r.setdefault("schema_version", SCHEMA_VERSION)
        r.setdefault("row_id", new_row_id())
        r.setdefault("created_at", utc_now())
        r.setdefault("repeat", 0)
        r.setdefault("error", "")
        r.setdefault("task", "")
        status = r.get("status")
        if status not in STATUSES:
            raise ValueError(f"row status {status!r} not in {STATUSES}")
        prov = provenance()
        for k in PROVENANCE_COLUMNS:
            r.setdefault(k, prov.get(k))
        return r

    def append(self, rows: list[dict] | dict, kind: str | None = None) -> Path | None:
        rows = [rows] if isinstance(rows, dict) else list(rows)
        if not rows:
            return None
        rows = [self.complete_row(r) for r in rows]
        df = _typed(pd.DataFrame(rows))
        try:
            self.parts.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvarnError(f"cannot create results directory {self.parts}: {e}") from None
        path = self._new_part(kind or rows[0].get("kind", "rows"))
        _write_atomic(df, path)
        return path

    def _new_part(self, kind: str) -> Path:
        """A fresh part name: kind, UTC time to the microsecond, a random suffix."""
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        return self.parts / f"{kind}-{stamp}-{uuid.uuid4().hex[:8]}.parquet"

    def compact(self) -> tuple[int, int]:
        """Merge all parts into one (e.g. before copying a results directory around: one file instead of one per
        cell). The merged part is written atomically before the old ones are removed; a crash in between leaves
        duplicates, which read() drops by row_id. Returns (parts before, rows)."""
        files = self.files()
        if len(files) <= 1:
            return len(files), len(self.read())
        df = self.read()
        _write_atomic(_typed(df), self._new_part("compact"))
        for f in files:
            f.unlink()
        return len(files), len(df)

    def merge(self, files: list[Path], kind: str = "rows") -> Path | None:
        """Merge the given parts (e.g. one run's per-problem parts) into one, as compact() does for all of them."""
        files = [Path(f) for f in files if Path(f).is_file()]
        if len(files) <= 1:
            return files[0] if files else None
        df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True, sort=False)
        path = self._new_part(kind)
        _write_atomic(_typed(df), path)
        for f in files:
            f.unlink()
        return path

    # ---- read --------------------------------------------------------------------------------
    def files(self) -> list[Path]:
        return sorted(self.parts.glob("*.parquet")) if self.parts.is_dir() else []

    def read(self, kind: str | None = None) -> pd.DataFrame:
        frames = []
        for p in self.files():
            try:
                frames.append(pd.read_parquet(p))
            except Exception as e:  # noqa: BLE001 - a foreign or damaged file must not hide the other results
                if p not in _WARNED:
                    _WARNED.add(p)
                    print(f"kvarn: skipping unreadable results part {p} ({type(e).__name__}: {str(e)[:120]}); "
                          "move it out of parts/ to silence this", file=sys.stderr)
        frames = [f for f in frames if len(f)]
        if not frames:
            return pd.DataFrame({c: pd.Series(dtype=t) for c, t in CORE_COLUMNS.items()})
        df = pd.concat(frames, ignore_index=True, sort=False)
        if "row_id" in df.columns:  # a compaction interrupted after writing its merged part
            df = df.drop_duplicates(subset="row_id", keep="first").reset_index(drop=True)
        if kind is not None:
            df = df[df["kind"] == kind].reset_index(drop=True)
        return df

    def done_keys(self, kind: str | None = None) -> set[tuple[str, int]]:
        """(config_hash, repeat) of rows that finished ok: a rerun skips these cells."""
        df = self.read(kind)
        if df.empty:
            return set()
        ok = df[df["status"] == "ok"]
        return set(zip(ok["config_hash"].astype(str), ok["repeat"].astype(int)))
