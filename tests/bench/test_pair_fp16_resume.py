"""--pair-fp16 resume: the newest row of a cell and repeat decides whether it is done."""
from kvarn.bench.plan import paired_done
from kvarn.report.fixtures import bench_row
from kvarn.results import ResultsStore

M = "Qwen/Qwen3-8B"


def _rows(root, *rows):
    ResultsStore(root).append(list(rows))


def test_a_newer_unpaired_rerun_makes_the_candidate_run_again(tmp_path):
    fp16 = bench_row(M, "auto", run_id="a", created_at="2026-01-01T00:00:00")
    paired = bench_row(M, "kvarn_k4v2_g128", run_id="a", created_at="2026-01-01T00:01:00", ratio_scope="same-run")
    _rows(tmp_path, fp16, paired)
    key = (paired["config_hash"], 0)
    assert {key, (fp16["config_hash"], 0)} == paired_done(tmp_path)
    # a forced rerun of the candidate alone: its ratios are unpaired, so the cell is not done for --pair-fp16
    _rows(tmp_path, bench_row(M, "kvarn_k4v2_g128", run_id="b", created_at="2026-01-02T00:00:00",
                              ratio_scope="unpaired"))
    assert key not in paired_done(tmp_path) and (fp16["config_hash"], 0) in paired_done(tmp_path)


def test_a_retried_cell_is_done_once_its_newest_row_is_ok(tmp_path):
    failed = bench_row(M, "auto", status="failed", error="boom", run_id="a", created_at="2026-01-01T00:00:00")
    _rows(tmp_path, failed)
    assert paired_done(tmp_path) == set()
    _rows(tmp_path, bench_row(M, "auto", run_id="b", created_at="2026-01-01T00:05:00"))
    assert paired_done(tmp_path) == {(failed["config_hash"], 0)}
