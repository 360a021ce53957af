"""The one results store: versioned schema, atomic append-only Parquet, config hashes for resume.

`bench` and `eval` write rows here; `report`, `gate` and `kvarn results` read them. docs/results.md documents it.
"""
from .schema import SCHEMA_VERSION, STATUSES, config_hash, new_row_id
from .store import ResultsStore

__all__ = ["SCHEMA_VERSION", "STATUSES", "ResultsStore", "config_hash", "new_row_id"]
