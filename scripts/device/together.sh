#!/usr/bin/env bash
# Several parts of scripts/device/run.sh at once on one GPU (correctness work that needs no quiet GPU), each with its
# own time limit and log:
#   bash scripts/device/run.sh "together:1100@KVARN_TOGETHER=gpusuite:900 accuracy:1050,KVARN_ACC_STEPS=models+niah,KVARN_GPUSUITE_FILES=tests/kernels/test_kernels_gpu.py"
# Every variable of the part reaches every child. KVARN_SHARED_GPU=1 keeps a child's free_gpu.sh from ending the
# others' engines; run.sh ends whatever is left once all are done. Never for timings: they would measure each other.
# Memory: every vLLM engine asks for its share at start and fails when the free memory is short. Beside six-format
# accuracy evals (six engines per eval) the GPU suite's kernel tests pass, its engine tests and smoke fail at start:
# give it KVARN_GPUSUITE_FILES=tests/kernels/test_kernels_gpu.py there, and run the rest on a GPU of its own.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
DIR="$(cd "$(dirname "$0")" && pwd)"
read -r -a parts <<< "${KVARN_TOGETHER:?KVARN_TOGETHER=\"PART:SECS PART:SECS\" names the parts}"
export KVARN_SHARED_GPU=1
pids=(); names=()
for spec in "${parts[@]}"; do
  part=${spec%%:*}; secs=${KVARN_PART_TIMEOUT:-240}; [ "$spec" != "$part" ] && secs=${spec#*:}
  [ -f "$DIR/$part.sh" ] || { echo "together: no part $part ($DIR/$part.sh)"; exit 2; }
  KVARN_PART=$part KVARN_PART_SECS=$secs timeout -k 10 "$secs" bash "$DIR/$part.sh" > "$OUT/$part.log" 2>&1 &
  pids+=($!); names+=("$part")
  echo "started $part (at most $secs s)"
done
T0=$(date +%s); rc_all=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?; [ $rc -ne 0 ] && rc_all=$rc
  echo "=== ${names[$i]} rc=$rc after $(( $(date +%s) - T0 )) s; last lines:"; tail -n "${KVARN_TAIL:-25}" "$OUT/${names[$i]}.log"
done
exit $rc_all
