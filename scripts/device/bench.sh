#!/usr/bin/env bash
# `kvarn bench` on the lent H200. Assumes PYTHONPATH=/tmp/kvarn-site:/tmp/site (vLLM 0.26 + kvarn) and
# VLLM_USE_FLASHINFER_SAMPLER=0, as scripts/device/run.sh sets them:
#   KVARN_PART_TIMEOUT=500 bash scripts/device/run.sh bench                 (offline matrix, ~8 min)
#   KVARN_BENCH_PART=serve KVARN_PART_TIMEOUT=300 bash scripts/device/run.sh bench   (serve-mode check, ~4 min)
# offline: Qwen3-8B shape, dummy weights, 64 x (1024 + 512) burst for auto, fp8, kvarn_k4v2_g128 (if the plugin
#   imports), turboquant_k3v4_nc, turboquant_4bit_nc; each cell a fresh engine process with a 300 s timeout (the
#   first TurboQuant start compiles for minutes). The showcase (96 x (14336 + 2048)) is the same command
#   with --burst 16k --requests 96 --prompt-len 14336; it needs ~25 min for five formats.
# A cell longer than one call (TurboQuant at the showcase burst: ~10-12 min with its compile) runs in the background
# and is collected by back-to-back calls (the machine must stay warm: < 30 s between calls):
#   KVARN_BG=1 KVARN_BENCH_KV=turboquant_k3v4_nc KVARN_BENCH_SHAPE="--burst 16k --requests 96 --prompt-len 14336
#     --output-len 2048" KVARN_BENCH_TIMEOUT=1100 KVARN_BENCH_BUDGET=1150 bash scripts/device/run.sh bench:1200
#   bash scripts/device/run.sh wait:560      (again until it prints the table)
# serve: Qwen3-0.6B shape, `vllm serve` + streamed /v1/completions, 32 x (1024 + 256), goodput SLOs.
# Results: $OUT/bench (Parquet parts + logs/<config_hash>-r<k>.log). Last: the summary table with ratios vs FP16.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false COLUMNS=220
BUDGET="${KVARN_BENCH_BUDGET:-450}"   # seconds for kvarn bench; the table is printed after it in any case
RES="$OUT/bench"
KVARN="kvarn"; command -v kvarn >/dev/null 2>&1 || KVARN="python3 -m kvarn_cli.app"

if [ "${KVARN_BENCH_PART:-offline}" = serve ]; then
  timeout -k 20 "$BUDGET" $KVARN bench --engine vllm --mode serve --model qwen3-0.6b --dummy-weights \
    --kv-dtype "${KVARN_SERVE_KV:-auto,kvarn_k4v2_g128}" --burst 1280 --prompt-len 1024 --requests 32 --timeout 300 \
    --goodput "ttft:2000 tpot:50" --gpu-memory-utilization 0.5 --out "$RES" 2>&1 | tail -n 40
else
  kv="auto,fp8"
  if python3 -c "import kvarn.vllm_plugin" >/dev/null 2>&1; then kv="$kv,kvarn_k4v2_g128"; else
    echo "kvarn vLLM plugin does not import: kvarn_k4v2_g128 left out"; fi
  kv="${KVARN_BENCH_KV:-$kv,turboquant_k3v4_nc,turboquant_4bit_nc}"
  # KVARN_BENCH_SHAPE: e.g. "--burst 16640 --prompt-len 16384 --requests 64" (the prefill-heavy burst); KVARN_BENCH_MODEL: a
  # bundled shape, e.g. qwen3-32b with KVARN_BENCH_SHAPE="... --max-num-seqs 96" (the tail reserve must fit the burst)
  read -r -a shape <<< "${KVARN_BENCH_SHAPE:---burst 1536 --prompt-len 1024 --requests 64}"
  $KVARN bench --engine vllm --model "${KVARN_BENCH_MODEL:-qwen3-8b}" --kv-dtype "$kv" "${shape[@]}" \
    --dummy-weights --timeout "${KVARN_BENCH_TIMEOUT:-300}" --out "$RES" --dry-run 2>&1 | tail -n 15
  timeout -k 20 "$BUDGET" $KVARN bench --engine vllm --model "${KVARN_BENCH_MODEL:-qwen3-8b}" --kv-dtype "$kv" "${shape[@]}" \
    --dummy-weights --timeout "${KVARN_BENCH_TIMEOUT:-300}" --out "$RES" > "$OUT/${KVARN_PART:-bench}_cli.log" 2>&1
  echo "kvarn bench rc=$? (124 = budget spent; unfinished cells resume on the next run)"
  grep -E "^(ok|failed|timeout|oom|skipped) " "$OUT/${KVARN_PART:-bench}_cli.log" | tail -n 10
fi
# leftover engines of an interrupted cell keep GPU memory
bash "$(dirname "$0")/free_gpu.sh"

# the failed cells' log tails printed here; the Parquet parts come back as files, the logs inside logs.tar.xz.
# To resume in a later call: copy bench/parts here into .device/results/parts and carry .device/results.
python3 - "$RES" <<'PY'
import pathlib, sys
from kvarn.results import ResultsStore
res = pathlib.Path(sys.argv[1])
store = ResultsStore(res)
df = store.read("bench")
for r in (df[df.status != "ok"].to_dict("records") if not df.empty else []):
    log = res / "logs" / f"{r['config_hash']}-r{int(r['repeat'])}.log"
    if log.exists():
        print(f"--- {r['kv_dtype']} ({r['status']}) log tail:")
        print("\n".join(log.read_text(errors="replace").splitlines()[-8:]))
store.compact()
PY
# the engine logs stay (run.sh packs them into logs.tar.xz): a stall or a timeout is read there
rm -rf "$RES"/logs/*.work/model

python3 - "$RES" <<'PY'
import sys
from rich.console import Console
from kvarn.bench.view import stall_notes, summary_table
from kvarn.results import ResultsStore
df = ResultsStore(sys.argv[1]).read("bench")
if df.empty:
    print("no bench rows were written"); sys.exit(0)
for r in df[df.status != "ok"].to_dict("records"):
    print(f"{r['kv_dtype']}: {r['status']}: {r['error']}")
Console(width=220).print(summary_table(df.to_dict("records"), title="kvarn bench on the H200"))
print("\n".join(stall_notes(df.to_dict("records"))))
PY
