"""One rule says which stored bench rows are current, and the report, the gate, the README table and bench's
--pair-fp16 resume all read it: after a partial resume they judge the same rows with the same ratio scopes."""
import pandas as pd

from kvarn.bench.plan import paired_done
from kvarn.bench.ratios import with_ratios
from kvarn.gate import run_gate
from kvarn.report.data import bench_cells, normalise_bench, split_superseded
from kvarn.report.fixtures import bench_row
from kvarn.report.readme_table import readme_lines
from kvarn.results import ResultsStore
from kvarn.results.current import SUPERSEDED_OK, current_rows

M = "Qwen/Qwen3-8B"


def row(kv, repeat, tok_s, run, at, rid, status="ok"):
    return bench_row(M, kv, 1, repeat=repeat, output_tok_s=tok_s, kv_tokens=800_000 if kv == "auto" else 3_600_000,
                     burst=16384, run_id=run, row_id=rid, created_at=at, status=status)


def partial_resume():
    """Run A measured repeats 0 and 1 of both formats and failed KVarN's repeat 2; run B (the resume) redid that
    repeat alone, with no FP16 row of its own: its ratio is unpaired."""
    a = [row(kv, r, t + r, "A", f"2026-01-01T10:0{r}:{i}0", f"a{kv[0]}{r}")
         for i, (kv, t) in enumerate((("auto", 2600.0), ("kvarn_k4v2_g128", 4500.0))) for r in range(3)]
    a[-1].update(status="failed", error="engine died", output_tok_s=float("nan"))
    b = [row("kvarn_k4v2_g128", 2, 4400.0, "B", "2026-01-02T09:00:00", "bk2")]
    return with_ratios(pd.DataFrame(a + b))


def test_the_newest_row_of_each_configuration_and_repeat_is_current():
    cur, old = current_rows(partial_resume())
    assert sorted(cur["row_id"]) == ["aa0", "aa1", "aa2", "ak0", "ak1", "bk2"]
    assert list(old["row_id"]) == ["ak2"] and list(old["superseded_by"]) == ["B"]
    assert not cur[SUPERSEDED_OK].any()


def test_a_failed_rerun_of_an_ok_row_is_current_and_flagged():
    rows = pd.DataFrame([row("auto", 0, 2600.0, "A", "2026-01-01T10:00:00", "ok"),
                         row("auto", 0, float("nan"), "B", "2026-01-02T10:00:00", "bad", status="failed")])
    cur, old = current_rows(rows)
    assert list(cur["row_id"]) == ["bad"] and bool(cur[SUPERSEDED_OK].iloc[0])
    assert list(old["row_id"]) == ["ok"]


def test_report_gate_readme_and_resume_read_the_same_rows(tmp_path):
    df = partial_resume()
    ResultsStore(tmp_path / "res").append(df.to_dict("records"))
    cur, sup = split_superseded(normalise_bench(df))
    assert sorted(cur["row_id"]) == sorted(current_rows(df)[0]["row_id"]) and sup.empty  # the failed row: neither
    cell = bench_cells(cur).set_index("kv_dtype").loc["kvarn_k4v2_g128"]
    # the cell keeps run A's two paired repeats beside run B's unpaired one: a same-run ratio, from A's rows
    assert cell["valid_runs"] == 3 and cell["ratio_vs"] == "same-run"
    assert abs(cell["kv_ratio_vs_fp16"] - 4.5) < 1e-9
    line = next(ln for ln in readme_lines(df) if ln["kv_dtype"] == "kvarn_k4v2_g128")
    assert line["row"]["run_id"] == "A" and line["scope"] == "same-run"
    # bench --pair-fp16 redoes exactly the unpaired current repeat
    done = paired_done(tmp_path / "res")
    k = df.set_index("row_id").loc["bk2", "config_hash"]
    assert (k, 2) not in done and (k, 0) in done and (k, 1) in done
    # and the gate, gating the run against itself, judges the same three repeats
    verdict = run_gate(tmp_path / "res", tmp_path / "res")
    assert "1 bench row superseded" in " ".join(verdict["notes"])


def test_a_stored_unpaired_scope_is_not_given_a_ratio_by_the_report():
    """The candidate was written before its run's FP16 row existed: unpaired for the gate, so for the report too."""
    df = with_ratios(pd.DataFrame([row("kvarn_k4v2_g128", 0, 4500.0, "A", "2026-01-01T10:00:00", "k")]))
    df = pd.concat([df, pd.DataFrame([row("auto", 0, 2600.0, "A", "2026-01-01T10:05:00", "f")])], ignore_index=True)
    cell = bench_cells(normalise_bench(df)).set_index("kv_dtype").loc["kvarn_k4v2_g128"]
    assert cell["ratio_vs"] == "unpaired" and pd.isna(cell["kv_ratio_vs_fp16"])
