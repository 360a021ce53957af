#!/usr/bin/env bash
# KVarN Triton kernels on the GPU (every step has its own timeout; KVARN_STORE_SECS=150 for the store, 0 skips it;
# KVARN_STORE_ITERS=8,3 passes --balance-iters to time the flush at those balancing iteration counts side by side):
# the microbench targets, then a short correctness smoke.
#   bash scripts/device/kernels.sh          (logs and JSON under "$OUT", default ./out-kernels)
# Prints a compact table last: decode vs FlashAttention fp16 at several shapes, store flush share, prefill.
set -u
OUT="${OUT:-$PWD/out-kernels}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# inside run.sh's bundle kvarn is installed with --target (no console script): run the module then
KVARN="kvarn"; command -v kvarn >/dev/null 2>&1 || KVARN="python3 -m kvarn_cli.app"
T0=$(date +%s)
pip install -q -e . --no-deps >"$OUT/pip.log" 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >"$OUT/gpu.txt" 2>&1 || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$OUT/gpu.txt" 2>&1
: >"$OUT/status.txt"

# the whole part's budget (run.sh passes its PART:SECS limit as KVARN_PART_SECS), minus a reserve for the table: a
# step that would run past it is shortened or skipped, so the table below always prints (a cut part printed nothing)
BUDGET=$(( ${KVARN_PART_SECS:-${KVARN_KERNELS_SECS:-400}} - 20 ))
mb() {  # name, seconds, args...
  local name=$1 secs=$2 t=$(date +%s); shift 2
  local left=$(( BUDGET - (t - T0) ))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 5 ]; then echo "mb_$name skipped (part budget spent)" >>"$OUT/status.txt"; return; fi
  timeout "$secs" $KVARN microbench "$@" --json >"$OUT/mb_$name.json" 2>"$OUT/mb_$name.err"
  echo "mb_$name rc=$? $(( $(date +%s) - t ))s" >>"$OUT/status.txt"
}
H200="--batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 --kv-dtype kvarn_k4v2_g128"
# 1. the acceptance shape first (checked against the fp32 reference; a fresh machine compiles every kernel here)
mb decode 60 decode $H200 --check
# 2. other shapes: the showcase burst's batch, the Qwen3-32B decode step (GQA group 8), few rows, D=64
mb decode_b96 25 decode --batch 96 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128
mb decode_32b 25 decode --batch 128 --context 4096 --q-heads 64 --kv-heads 8 --head-dim 128 --check
mb decode_b8 15 decode --batch 8 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 --check
mb decode_c4k 12 decode --batch 64 --context 4096 --q-heads 32 --kv-heads 8 --head-dim 128
mb decode_d64 15 decode --batch 64 --context 8192 --q-heads 9 --kv-heads 3 --head-dim 64 --check
[ "${KVARN_STORE_SECS:-150}" != 0 ] && mb store "${KVARN_STORE_SECS:-150}" store --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 --model qwen3-8b --check ${KVARN_STORE_ITERS:+--balance-iters $KVARN_STORE_ITERS}
mb prefill 20 prefill --batch 4 --context 8192 --q-heads 32 --kv-heads 8 --head-dim 128 --chunk 512 --check
# 3. a short correctness smoke on the compiled path (graph capture, one decode preset, the dense prefill)
left=$(( BUDGET - ($(date +%s) - T0) )); [ "$left" -gt 60 ] && left=60
if [ "$left" -gt 5 ]; then
  timeout "$left" python -m pytest -q -m gpu tests/kernels/test_kernels_gpu.py -x -p no:cacheprovider \
    -k "cuda_graph or store_matches or store_decode or (decode_matches and 128-32-8) or dense_prefill" \
    >"$OUT/pytest_gpu.log" 2>&1
  echo "pytest_gpu rc=$?" >>"$OUT/status.txt"
fi

# 4. the compact table, last
python - "$OUT" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
status = (out / "status.txt").read_text()
print(status.strip())
p = out / "pytest_gpu.log"
tail = p.read_text().strip().splitlines() if p.exists() else []
print("pytest smoke:", tail[-1] if tail else "(not run)")
rows = {}
for p in sorted(out.glob("mb_*.json")):
    try:
        rows[p.stem[3:]] = json.loads(p.read_text().strip().splitlines()[-1])
    except Exception:
        err = (out / (p.stem + ".err")).read_text().strip()
        cut = re.search(rf"^{p.stem} rc=124 ", status, re.M)
        print(f"{p.stem[3:]:<11} " + ("cut by its time limit (rc=124) " if cut else "FAILED: ")
              + err[-300:].replace("\n", " | "))
print(f"\n{'target':<11} {'ours ms':>9} {'base ms':>9} {'ratio':>7} {'GB/s':>7} {'%copy':>6} {'rel err':>9}  note")
for name, r in rows.items():
    e = r["extra"]
    if r["kernel"] == "store":
        note = f"flush/step {e['flush_frac_of_step']:.2%} amortized {e['amortized_frac']:.3%}"
        if "flush_layers_ms" in e:  # every layer's tile in one launch (flush_layers), GPU time and call time
            note += (f" | one launch for all layers {e['flush_layers_ms']:.4f} ms = "
                     f"{e['flush_layers_frac_of_step']:.2%} (call {e['flush_layers_host_ms']:.4f} ms)")
    elif r["kernel"] == "decode":
        note = f"B={r['batch']} ctx={r['context']} {r['q_heads']}/{r['kv_heads']} D={r['head_dim']} " \
               f"ideal {e.get('ideal_ratio_bytes', 0):.2f}x splits={e.get('splits')}"
    else:
        note = f"B={r['batch']} ctx={r['context']} chunk={e.get('chunk')} ({e.get('path')})"
    err = "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
    print(f"{name:<11} {r['ms']:9.4f} {r['baseline_ms'] or 0:9.4f} {r['ratio'] or 0:7.3f} {r['gbps']:7.1f} "
          f"{100 * r['bw_frac']:6.1f} {err:>9}  {note}")
PY
