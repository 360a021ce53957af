#!/usr/bin/env bash
# GPU checks + microbench targets of the KVarN Triton kernels (issue 4). Run from the repo root on the device:
#   bash scripts/device/kernels.sh          (logs and JSON under "$OUT", default ./out-kernels; ~4 minutes max)
# Prints a short table last: decode vs FlashAttention fp16 (target <= 0.35x), store flush share (< 2%), errors.
set -u
OUT="${OUT:-$PWD/out-kernels}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
pip install -q -e . --no-deps >"$OUT/pip.log" 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1 || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$OUT/gpu.txt" 2>&1

# 1. correctness on the compiled path (bf16 MMAs, D 64/128/256, all presets, CUDA-graph capture)
timeout 130 python -m pytest -q -m gpu tests/test_kernels_gpu.py -x -p no:cacheprovider >"$OUT/pytest_gpu.log" 2>&1
echo "pytest_gpu rc=$?" >"$OUT/status.txt"

# 2. microbench targets (the H200 acceptance shape), each bounded
mb() {  # name, seconds, args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" kvarn microbench "$@" --json >"$OUT/mb_$name.json" 2>"$OUT/mb_$name.err"
  echo "mb_$name rc=$?" >>"$OUT/status.txt"
}
mb decode 40 decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 --kv-dtype kvarn_k4v2_g128 --check
mb decode_s8 25 decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 --num-splits 8
mb decode_b8 25 decode --batch 8 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 --check
mb store 35 store --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 --model qwen3-8b --check
mb prefill 35 prefill --batch 4 --context 8192 --q-heads 32 --kv-heads 8 --head-dim 128 --chunk 512 --check

# 3. the short table, last
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print((out / "status.txt").read_text().strip())
tail = (out / "pytest_gpu.log").read_text().strip().splitlines()
print("pytest:", tail[-1] if tail else "(no output)")
print(f"{'target':<10} {'ours ms':>9} {'base ms':>9} {'ratio':>7} {'GB/s':>8} {'%copy':>6} {'rel err':>9}  note")
for p in sorted(out.glob("mb_*.json")):
    try:
        r = json.loads(p.read_text().strip().splitlines()[-1])
    except Exception:
        print(f"{p.stem[3:]:<10} FAILED: " + (out / (p.stem + ".err")).read_text().strip()[-200:].replace("\n", " | "))
        continue
    e = r["extra"]
    note = r["baseline"] if r["kernel"] != "store" else \
        f"flush/step {e['flush_frac_of_step']:.2%} amortized {e['amortized_frac']:.3%}"
    err = "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
    print(f"{p.stem[3:]:<10} {r['ms']:9.4f} {r['baseline_ms'] or 0:9.4f} {r['ratio'] or 0:7.3f} {r['gbps']:8.1f} "
          f"{100 * r['bw_frac']:6.1f} {err:>9}  {note}")
PY
