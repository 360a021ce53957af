#!/usr/bin/env bash
# GPU calibration, ~1 min: the decode acceptance shape (ours and FlashAttention fp16, median of many CUDA-event
# timed runs), three times. Run as the first part of every lane of a multi-GPU call (bash scripts/device/run.sh
# calib:90 ...) so cells measured on different GPUs of one host can be compared like for like.
set -u
nvidia-smi ${KVARN_GPU:+-i "$KVARN_GPU"} --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv,noheader
for i in 1 2 3; do
  kvarn microbench decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 \
    --kv-dtype kvarn_k4v2_g128 --json 2>/dev/null | tail -n 1 | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); \
print(f\"calib run $i: kvarn {r['ms']:.4f} ms, fp16 baseline {r['baseline_ms']:.4f} ms, ratio {r['ratio']:.3f}\")"
done
