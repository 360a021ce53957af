import os

import pandas as pd
import pytest

from kvarn.results import ResultsStore, config_hash


def test_append_read_resume_keys(tmp_path):
    s = ResultsStore(tmp_path / "res")
    h = config_hash({"model": "m", "kv_dtype": "auto"})
    assert h == config_hash({"kv_dtype": "auto", "model": "m"})  # key order does not matter
    s.append({"kind": "bench", "config_hash": h, "repeat": 0, "status": "ok", "model": "m", "kv_dtype": "auto",
              "engine": "hf", "tp": 1, "seed": 0, "output_tok_s": 12.5, "run_id": "r1"})
    s.append([{"kind": "bench", "config_hash": "x", "repeat": 0, "status": "failed", "error": "boom", "model": "m",
               "kv_dtype": "fp8", "engine": "hf", "tp": 1, "seed": 0, "run_id": "r1"}])
    df = s.read()
    assert len(df) == 2 and set(df["status"]) == {"ok", "failed"}
    assert df.loc[df.status == "ok", "output_tok_s"].item() == 12.5
    assert s.done_keys("bench") == {(h, 0)}  # failed cells are redone
    for col in ("schema_version", "row_id", "created_at", "git_sha", "torch", "gpu_count"):
        assert col in df.columns
    assert not list((tmp_path / "res" / "parts").glob("*.tmp"))


def test_empty_store_and_bad_status(tmp_path):
    s = ResultsStore(tmp_path)
    assert s.read().empty and s.done_keys() == set()
    with pytest.raises(ValueError):
        s.append({"kind": "bench", "status": "weird"})


def test_compact_merges_parts_and_interrupted_compaction_dedupes(tmp_path):
    s = ResultsStore(tmp_path / "res")
    for i in range(3):
        s.append({"kind": "bench", "config_hash": f"h{i}", "status": "ok", "model": "m", "kv_dtype": "auto",
                  "engine": "hf", "tp": 1, "seed": 0, "output_tok_s": float(i), "run_id": "r"})
    before = s.read()
    assert len(s.files()) == 3
    assert s.compact() == (3, 3)
    assert len(s.files()) == 1 and s.files()[0].name.startswith("compact-")
    after = s.read()
    assert sorted(after["row_id"]) == sorted(before["row_id"]) and s.done_keys("bench") == {("h0", 0), ("h1", 0),
                                                                                              ("h2", 0)}
    # a crash after the merged part was written but before the old parts went: rows read once
    merged = s.files()[0]
    (merged.parent / "bench-old.parquet").write_bytes(merged.read_bytes())
    assert len(s.read()) == 3
    assert s.compact() == (2, 3) and len(s.files()) == 1
