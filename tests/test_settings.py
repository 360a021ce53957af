"""kvarn.settings: how a KVARN_* setting's value is read, a bad value as one clear error, and what result rows
record of the settings (a run with another value is another cell)."""
import pytest

from kvarn import settings
from kvarn.errors import KvarnError


def test_deferred_flush_is_on_unless_set_to_0(monkeypatch):
    from kvarn.vllm_plugin.common import defer_flush_enabled

    for value, on in ((None, True), ("", True), (" 1 ", True), ("0", False), ("off", False)):
        if value is None:
            monkeypatch.delenv("KVARN_DEFER_FLUSH", raising=False)
        else:
            monkeypatch.setenv("KVARN_DEFER_FLUSH", value)
        settings.reload()
        assert defer_flush_enabled() is on, value
        # the results record what ran: the flag is listed with its effective value
        assert f"KVARN_DEFER_FLUSH={int(on)}" in settings.result_env()


def test_result_env_records_every_result_changing_setting():
    """Rows record the result-changing settings with their effective values (set or not), so a run with another
    value is another cell; a setting that changes no number (KVARN_FULL_GRAPH) stays out of accuracy rows, and the
    hf engine's rows (the method's scope) carry the method's settings alone."""
    from kvarn.bench.config import BenchConfig

    assert settings.result_env({}) == "KVARN_BALANCE_ITERS=3;KVARN_DEFER_FLUSH=1;KVARN_SINK=16"
    assert settings.result_env({"KVARN_BALANCE_ITERS": "8", "KVARN_DEFER_FLUSH": "false", "KVARN_FULL_GRAPH": "0",
                                "OTHER": "x"}) == "KVARN_BALANCE_ITERS=8;KVARN_DEFER_FLUSH=0;KVARN_SINK=16"
    assert settings.result_env({"KVARN_BALANCE_ITERS": "2", "KVARN_SINK": "0"}, scopes=("method",)) == \
        "KVARN_BALANCE_ITERS=2;KVARN_SINK=0"
    base = dict(model="m", kv_dtype="kvarn_k4v2_g128", tp=1, engine="vllm", mode="offline", burst=2048,
                prompt_len=1024, output_len=1024, requests=4, gpu_memory_utilization=0.9, max_num_seqs=None,
                dummy_weights=True, seed=0)
    a = BenchConfig(**base, backend_env=settings.result_env({}))
    b = BenchConfig(**base, backend_env=settings.result_env({"KVARN_SINK": "0"}))
    assert a.hash != b.hash  # a setting makes its own cell (resume never mixes them)


def test_bad_setting_is_one_clear_error(monkeypatch):
    for name, raw, msg in (("KVARN_SINK", "many", "KVARN_SINK='many': accepted values are an integer >= 0"),
                           ("KVARN_SINK", "-1", "an integer >= 0"),
                           ("KVARN_DEFER_FLUSH", "maybe", "accepted values are 1 / 0"),
                           ("KVARN_PROGRESS_S", "x", "a number >= 0")):
        monkeypatch.setenv(name, raw)
        settings.reload()
        with pytest.raises(KvarnError, match=msg):
            settings.get(name)
    assert len(set(s.name for s in settings.SETTINGS)) == len(settings.SETTINGS)
