#!/usr/bin/env bash
# Where a decode (or prefill) step spends its time (`kvarn profile`), bounded to ~4 minutes. Assumes the environment
# of scripts/device/run.sh (PYTHONPATH with vLLM 0.26 + kvarn, VLLM_USE_FLASHINFER_SAMPLER=0):
#   KVARN_PART_TIMEOUT=250 bash scripts/device/run.sh profile
#   bash scripts/device/run.sh profile:250@KVARN_PROFILE_PHASE=prefill,KVARN_PROFILE_CONTEXT=1024   (time to first token)
# Qwen3-8B shape, dummy weights, B=64 requests prefilled to C=4096 (lengths staggered over one tile), then 20 decode
# steps under torch.profiler + CUDA events, for `auto` (FP16 baseline) and kvarn_k4v2_g128, each in its own engine
# process (~60-80 s start each). KVARN_PROFILE_PHASE=prefill profiles the fill instead; KVARN_PROFILE_MODEL (a
# bundled shape), KVARN_PROFILE_BATCH and KVARN_PROFILE_CONTEXT change the model, B and C; KVARN_PROFILE_ENGINE_ARGS
# (space-separated key=value) adds engine arguments, e.g. max_num_batched_tokens=8192 (`vllm serve`'s step budget,
# where the offline engine's is 16,384). Results: $OUT/profile
# (JSON, worker logs, chrome traces). Tables last.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/profile"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false COLUMNS=200
KVARN="kvarn"; command -v kvarn >/dev/null 2>&1 || KVARN="python3 -m kvarn_cli.app"
ARGS=(--model "${KVARN_PROFILE_MODEL:-qwen3-8b}" --batch "${KVARN_PROFILE_BATCH:-64}"
      --context "${KVARN_PROFILE_CONTEXT:-4096}"
      --phase "${KVARN_PROFILE_PHASE:-decode}" --steps "${KVARN_PROFILE_STEPS:-20}" --timeout 150
      --workdir "$OUT/profile/work")
[ -n "${KVARN_PROFILE_TRACE:-}" ] && ARGS+=(--trace "$OUT/profile/traces")
for a in ${KVARN_PROFILE_ENGINE_ARGS:-}; do ARGS+=(-E "$a"); done
timeout -k 10 "${KVARN_PROFILE_BUDGET:-235}" $KVARN profile "${ARGS[@]}" --kv-dtype "${KVARN_PROFILE_DTYPES:-auto,kvarn_k4v2_g128}" \
  --json > "$OUT/profile/profile.jsonl" 2> "$OUT/profile/profile.err"
echo "kvarn profile rc=$? (124 = budget spent)"; tail -n 5 "$OUT/profile/profile.err"
bash "$(dirname "$0")/free_gpu.sh"
# the tables, last (rendered from the JSON so a dtype that finished is shown even if a later one was cut)
python3 - "$OUT/profile" <<'PY'
import json, pathlib, sys
from kvarn_cli.commands.profile import _print_compare, _print_one
d = pathlib.Path(sys.argv[1])
rows = [json.loads(l) for l in (d / "profile.jsonl").read_text().splitlines() if l.strip()] if (d / "profile.jsonl").exists() else []
if not rows:  # cut before printing: the per-dtype results the workers wrote
    rows = [json.loads(p.read_text()) for p in sorted((d / "work").glob("*/result.json"))]
    from kvarn.bench.profile import step_rows
    for r in rows:
        if r.get("status") == "ok":
            r["rows"] = step_rows(r)
if not rows:
    print("no profile results were written"); sys.exit(0)
for r in rows:
    _print_one(r)
if sum(r.get("status") == "ok" for r in rows) > 1:
    _print_compare(rows)
PY
