#!/usr/bin/env bash
# GPU calibration, ~1 min: the decode acceptance shape (ours and FlashAttention fp16, median of many CUDA-event
# timed runs), three times. Run as the first part of every lane of a multi-GPU call (bash scripts/device/run.sh
# calib:90 ...) so cells measured on different GPUs of one host can be compared like for like.
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
KVARN="kvarn"; command -v kvarn >/dev/null 2>&1 || KVARN="python3 -m kvarn_cli.app"
nvidia-smi ${KVARN_GPU:+-i "$KVARN_GPU"} --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv,noheader
for i in 1 2 3; do
  $KVARN microbench decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 \
    --kv-dtype kvarn_k4v2_g128 --json > "$OUT/calib$i.json" 2> "$OUT/calib$i.err"
  python3 - "$OUT/calib$i.json" "$i" <<'PY' || tail -n 5 "$OUT/calib$i.err"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(f"calib run {sys.argv[2]}: kvarn {r['ms']:.4f} ms, fp16 baseline {r['baseline_ms']:.4f} ms, "
      f"ratio {r['ratio']:.3f}")
PY
done
