"""`kvarn results`: listing and filtering stored rows as a table, JSON lines and CSV."""
import io
import json

import pandas as pd

from kvarn.results import ResultsStore
from kvarn_cli.app import main


def _store(tmp_path):
    s = ResultsStore(tmp_path / "res")
    base = {"kind": "bench", "engine": "vllm", "tp": 1, "seed": 0, "repeat": 0, "run_id": "r1", "burst": 16384}
    s.append([{**base, "config_hash": "a", "model": "Qwen/Qwen3-8B", "kv_dtype": "auto", "status": "ok",
               "output_tok_s": 100.0},
              {**base, "config_hash": "b", "model": "Qwen/Qwen3-8B", "kv_dtype": "fp8", "status": "ok",
               "output_tok_s": 111.0},
              {**base, "config_hash": "c", "model": "Qwen/Qwen3-32B", "kv_dtype": "turboquant_k3v4_nc",
               "status": "timeout", "error": "no result after 1800 s"}])
    s.append({"kind": "eval", "config_hash": "e", "model": "Qwen/Qwen3-8B", "kv_dtype": "fp8", "engine": "vllm",
              "tp": 1, "seed": 0, "task": "aime25", "status": "ok", "accuracy": 0.5, "run_id": "r2"})
    return tmp_path / "res"


def test_filters_and_formats(tmp_path, capsys):
    d = str(_store(tmp_path))
    assert main(["results", d, "--kind", "bench", "--model", "qwen3-8b", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["kv_dtype"] for r in rows] == ["auto", "fp8"] and all(r["kind"] == "bench" for r in rows)
    assert main(["results", d, "--kv-dtype", "fp8", "--csv", "--columns", "kind,kv_dtype,status"]) == 0
    df = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert list(df.columns) == ["kind", "kv_dtype", "status"] and sorted(df.kind) == ["bench", "eval"]
    assert main(["results", d, "--status", "timeout,failed", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == 1 and rows[0]["model"] == "Qwen/Qwen3-32B" and rows[0]["output_tok_s"] is None
    assert main(["results", d, "--kind", "bench"]) == 0
    table = capsys.readouterr().out
    assert "3 rows" in table and "Qwen" in table
    assert main(["results", d, "--model", "llama"]) == 0
    assert "no rows match" in capsys.readouterr().out
    # the configuration columns people slice by: numbers compare as numbers (16k = 16384 = 16384.0)
    assert main(["results", d, "--burst", "16k", "--tp", "1", "--engine", "vllm", "--kind", "bench", "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(["results", d, "--task", "aime25", "--json"]) == 0
    assert [json.loads(x)["kind"] for x in capsys.readouterr().out.splitlines()] == ["eval"]
    assert main(["results", d, "--tp", "2"]) == 0 and "no rows match" in capsys.readouterr().out
    # bench's alias of the offline mode selects the same rows
    assert main(["results", d, "--mode", "throughput", "--json"]) == 0
    throughput = capsys.readouterr().out
    assert main(["results", d, "--mode", "offline", "--json"]) == 0
    assert capsys.readouterr().out == throughput


def test_bad_input(tmp_path, capsys):
    d = str(_store(tmp_path))
    for argv, msg in ((["results", str(tmp_path / "nope")], "does not exist"),
                      (["results", str(tmp_path)], "no results in"),
                      (["results", d, "--status", "great"], "unknown --status 'great'"),
                      (["results", d, "--columns", "kind,bogus"], "unknown column 'bogus'"),
                      (["results", d, "--json", "--csv"], "one of --json and --csv"),
                      (["results", d, "--kind", "benchh"], "unknown --kind 'benchh'; accepted: bench, eval"),
                      (["results", d, "--burst", "16q"], "16q"),
                      (["results", d, "--last", "0"], "--last must be >= 1"),
                      (["results", d, "--last", "-1"], "--last must be >= 1 (the newest N rows), got -1"),
                      (["results", d, "--engine", "vlm"], "unknown --engine 'vlm'; accepted: vllm, hf"),
                      (["results", d, "--mode", "batch"], "unknown --mode 'batch'; accepted: offline, serve")):
        assert main(argv) == 2
        assert msg in capsys.readouterr().err


def test_compact_flag(tmp_path, capsys):
    d = _store(tmp_path)
    assert len(ResultsStore(d).files()) == 2
    assert main(["results", str(d), "--compact", "--kind", "bench"]) == 0
    out = capsys.readouterr().out
    assert "compacted 2 parts into 1 (4 rows)" in out and "3 rows" in out
    assert len(ResultsStore(d).files()) == 1


def test_narrow_terminal_keeps_the_key_columns(tmp_path, capsys, monkeypatch):
    from kvarn_cli import console

    d = str(_store(tmp_path))
    monkeypatch.setattr(console.out, "width", 80)
    assert main(["results", d, "--kind", "bench"]) == 0
    text = capsys.readouterr().out
    assert "turboquant_k3v4_nc" in text and "Qwen/Qwen3-32B" in text  # whole values, not folded
    assert "hidden for the terminal's width: created_at" in text and max(map(len, text.splitlines())) <= 80
