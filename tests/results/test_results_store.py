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


def test_parts_have_one_type_per_column_and_read_as_one_dataset(tmp_path):
    # a column null in one part (an offline row's request_rate, a CPU row's driver) and set in the next: both parts
    # carry the declared type, so pyarrow / pandas can scan parts/ as one dataset
    s = ResultsStore(tmp_path / "res")
    base = {"kind": "bench", "status": "ok", "model": "m", "kv_dtype": "auto", "engine": "vllm", "tp": 1, "seed": 0,
            "run_id": "r", "burst": 4096, "prompt_len": 512, "output_len": 3584, "requests": 8}
    s.append({**base, "config_hash": "a", "max_num_seqs": None, "request_rate": None, "driver": None,
              "kv_tokens": None, "engine_args": None})
    s.append({**base, "config_hash": "b", "max_num_seqs": 64, "request_rate": 2.5, "driver": "580.1",
              "kv_tokens": 1000, "engine_args": "{}"})
    df = pd.read_parquet(tmp_path / "res" / "parts")
    assert len(df) == 2 and df["max_num_seqs"].dtype == "float64" and df["request_rate"].dtype == "float64"
    assert sorted(df["max_num_seqs"].fillna(-1)) == [-1, 64] and df["burst"].tolist() == [4096, 4096]
    assert s.read()["driver"].dropna().tolist() == ["580.1"]


def test_an_unreadable_part_is_skipped_with_one_line(tmp_path, capsys):
    s = ResultsStore(tmp_path / "res")
    s.append({"kind": "bench", "config_hash": "h", "status": "ok", "model": "m", "kv_dtype": "auto", "engine": "hf",
              "tp": 1, "seed": 0, "run_id": "r"})
    bad = tmp_path / "res" / "parts" / "bench-zz-broken.parquet"
    bad.write_bytes(b"PAR1 not really")
    assert len(s.read()) == 1 and s.done_keys("bench") == {("h", 0)}
    err = capsys.readouterr().err
    assert err.count("skipping unreadable results part") == 1 and "bench-zz-broken.parquet" in err
    s.read()
    assert "skipping" not in capsys.readouterr().err  # said once per process
