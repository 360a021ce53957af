#!/usr/bin/env bash
# A short confirmation run on the H200 (~4 min): decode and the dense prefill vs FlashAttention in one run, and kvarn bench for FP16 vs KVarN on the Qwen3-8B shape (dummy weights, 64 x (1024 + 512)).
#   bash scripts/device/run.sh final        (after scripts/device/run.sh's staging)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=200
timeout 45 kvarn microbench decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 \
  --kv-dtype kvarn_k4v2_g128 --check --json 2>"$OUT/mb_decode.err" | tail -n 1 > "$OUT/mb_decode.json"
timeout 30 kvarn microbench prefill --batch 4 --context 8192 --q-heads 32 --kv-heads 8 --head-dim 128 --chunk 512 \
  --check --json 2>"$OUT/mb_prefill.err" | tail -n 1 > "$OUT/mb_prefill.json"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for name in ("mb_decode", "mb_prefill"):
    try:
        r = json.loads((pathlib.Path(sys.argv[1]) / f"{name}.json").read_text())
        print(f"{name}: ours {r['ms']:.4f} ms, baseline {r['baseline_ms'] or 0:.4f} ms ({r['baseline']}), "
              f"ratio {r['ratio'] or 0:.3f}, {r['gbps']:.0f} GB/s, rel err {r['rel_err']}")
    except Exception as e:  # noqa: BLE001
        print(f"{name}: no result ({e}); " + (pathlib.Path(sys.argv[1]) / f"{name}.err").read_text()[-300:])
PY
timeout -k 10 210 kvarn bench --engine vllm --model qwen3-8b --kv-dtype auto,kvarn_k4v2_g128 --burst 1536 \
  --prompt-len 1024 --requests 64 --dummy-weights --timeout 150 --out "$OUT/bench" > "$OUT/bench_cli.log" 2>&1
echo "kvarn bench rc=$?"
bash "$(dirname "$0")/free_gpu.sh"
python3 -c "
import sys
from kvarn.results import ResultsStore
df = ResultsStore('$OUT/bench').read('bench')
cols = ['kv_dtype', 'status', 'output_tok_s', 'total_tok_s', 'duration_s', 'completed', 'kv_tokens', 'kv_ratio_vs_fp16',
        'output_tok_s_ratio_vs_fp16', 'tpot_ms_p50', 'ttft_ms_p50', 'engine_start_s', 'error']
print(df[[c for c in cols if c in df.columns]].to_string())
"
