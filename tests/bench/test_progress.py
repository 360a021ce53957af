"""kvarn.bench.progress: the progress file a bench worker writes and what a timed-out row says of it."""


def test_progress_describes_each_phase(tmp_path):
    from kvarn.bench.progress import ProgressFile, describe, read_progress, row_metrics

    assert read_progress(tmp_path) == {} and describe({}) == ""
    p = ProgressFile(tmp_path, every_s=3600)
    p.update(force=True, phase="engine start")
    assert describe(read_progress(tmp_path)) == "reached: the engine start (not finished)"
    p.update(force=True, phase="warm-up", engine_start_s=152.1, kv_tokens=1129216.0)
    assert describe(read_progress(tmp_path)) == "reached: the warm-up (engine start 152.1 s)"
    p.update(phase="burst", completed=79, num_requests=96, generated_tokens=171520, total_output_tokens=161792,
             burst_s=548.2, burst_started_at=1000.0)
    assert read_progress(tmp_path)["phase"] == "warm-up"  # not yet written: at most every every_s seconds
    p.update(force=True)
    assert describe(read_progress(tmp_path)) == ("reached: 548 s into the burst, 79 of 96 requests done, "
                                                 "171,520 output tokens in the burst's first 548.2 s (313 out tok/s), "
                                                 "engine start 152.1 s")
    # killed later than the file's last write: the kill's seconds are said apart, the rate's seconds are the write's
    # (171,520 / 548.2 = 312.9), so the figures multiply out
    late = describe(read_progress(tmp_path), now=1600.0)
    assert "600 s into the burst" in late
    assert "171,520 output tokens in the burst's first 548.2 s (313 out tok/s)" in late
    # at the kill: seconds from the burst's recorded start
    assert describe(read_progress(tmp_path), now=1600.0).startswith("reached: 600 s into the burst, 79 of 96")
    assert row_metrics(read_progress(tmp_path)) == {"engine_start_s": 152.1, "kv_tokens": 1129216.0,
                                                    "completed": 79.0, "num_requests": 96.0,
                                                    "total_output_tokens": 161792.0}
    p.update(force=True, burst_tokens=196608)  # the burst's whole output (requests x output length)
    assert "171,520 of 196,608 (87%) output tokens in the burst's first 548.2 s (313 out tok/s)" in \
        describe(read_progress(tmp_path))
    p.update(force=True, generated_tokens=None)  # serve: only the finished requests' tokens are known
    assert "161,792 output tokens of finished requests" in describe(read_progress(tmp_path))
    (tmp_path / "progress.json").write_text("{half")
    assert read_progress(tmp_path) == {}
