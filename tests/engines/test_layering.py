"""kvarn.engines sits under bench and eval: it imports neither, nor vLLM, torch or transformers at import time."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("kvarn.engines", "kvarn.engines.gpus", "kvarn.engines.hf", "kvarn.engines.launch", "kvarn.engines.process",
           "kvarn.engines.vllm_args", "kvarn.engines.vllm_log", "kvarn.engines.vllm_worker")


def test_engines_import_no_bench_eval_or_heavy_library():
    code = (f"import sys\nfor m in {MODULES!r}: __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'transformers')\n"
            "             or m.startswith(('kvarn.bench', 'kvarn.eval')))\nprint(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_no_module_of_engines_names_bench_or_eval_in_an_import():
    for f in (ROOT / "kvarn" / "engines").glob("*.py"):
        for line in f.read_text().splitlines():
            s = line.strip()
            if s.startswith(("import ", "from ")):
                assert "bench" not in s and "eval" not in s, f"{f.name}: {s}"
