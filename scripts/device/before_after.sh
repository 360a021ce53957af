#!/usr/bin/env bash
# The same three measurements with an earlier kvarn (the base) and with this tree, one side after the other in one
# call on one GPU, so each before / after pair is from one run:
#   rm -rf .device/base && mkdir -p .device/base && git archive BASE_COMMIT | tar -x -C .device/base   # here
#   bash scripts/device/run.sh before_after:590      # carrying .device/base (and the bundle's .device/c5, bin, data)
# Each side: the decode microbench (B=64 x 16K, Qwen3-8B heads), the showcase burst (Qwen3-8B shape, dummy weights,
# 96 x (14,336 + 2,048): FP16 and kvarn_k4v2_g128 in one `kvarn bench` run), SmolLM2 chunked perplexity (2 x 4096,
# chunk 128) through vLLM; on request the store microbench (`store`: one tile x 36 layers, 128 tiles x 36 layers,
# a prefill step's store as the backend runs it, scripts/device/step_store.py: 32 prompts of 987 tokens x 28
# layers; with --mixed, a chunked-prefill step's store and attention) and the served short burst (`serve`:
# Qwen3-0.6B shape through `vllm serve`, 32 x (1,024 + 256) at once, KVARN_BA_SERVE_PROMPT=8192 for 8K prompts:
# TTFT and ITL; KVARN_BA_SERVE_REPEAT=N starts each cell's server N times in a row: the spread of one burst, and the
# later starts on a warm compile cache). KVARN_BA_SIDES picks base,
# head or base,head (the default); KVARN_BA_PARTS some of mb,store,bench,serve,ppl (default mb,bench,ppl);
# KVARN_BA_BASE_DTYPES the base side's bench
# formats (default FP16 and KVarN; kvarn_k4v2_g128 alone when only KVarN's code changed, vLLM's FP16 then measured
# once, beside this tree's KVarN); KVARN_BA_HEAD_DTYPES this tree's (default FP16 and KVarN; KVarN alone when the
# FP16 pairing is measured elsewhere and one call must hold both sides). Results under $OUT/<side>/.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=200 VLLM_USE_FLASHINFER_SAMPLER=0
BASE=.device/base
SMOL="${KVARN_SMOL:-/tmp/models/smollm2-135m-instruct}"
PARTS=",${KVARN_BA_PARTS:-mb,bench,ppl},"
SERVE_PROMPT="${KVARN_BA_SERVE_PROMPT:-1024}"   # the served burst's prompt tokens (its output: 256)
SERVE_REPEAT="${KVARN_BA_SERVE_REPEAT:-1}"   # servers per cell, one after the other
SIDES=",${KVARN_BA_SIDES:-base,head},"   # head alone: this tree's cells without a base (no before / after pair)
[[ $SIDES == *,base,* || $SIDES == *,head,* ]] || { echo "KVARN_BA_SIDES=$KVARN_BA_SIDES: give base, head or base,head"; exit 2; }
[[ $SERVE_REPEAT =~ ^[1-9][0-9]*$ ]] || { echo "KVARN_BA_SERVE_REPEAT=$SERVE_REPEAT: give a whole number >= 1"
                                         exit 2; }
if [[ $SIDES == *,base,* ]]; then
  [ -f "$BASE/pyproject.toml" ] || { echo "no base tree in $BASE (git archive BASE | tar -x -C $BASE, then carry it)"; exit 2; }
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kvarn-base-site --upgrade "$BASE" \
    > "$OUT/base-install.log" 2>&1 || { tail -5 "$OUT/base-install.log"; exit 3; }
fi
side() {  # name, site dir, bench formats: the kvarn that side imports (vLLM and torch from the bundle either way)
  local name=$1 site=$2 dtypes=$3 d="$OUT/$1"; mkdir -p "$d"
  # PYTHONSAFEPATH: `python -m` (here and in the engine workers) must not import the kvarn of the working directory
  kv() { PYTHONSAFEPATH=1 PYTHONPATH="$site:/tmp/site" timeout -k 10 "$@"; }
  case $PARTS in *,mb,*)
    kv 90 python3 -m kvarn_cli.app microbench decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 \
      --head-dim 128 --kv-dtype kvarn_k4v2_g128 --check --json 2>"$d/mb.err" | tail -n 1 > "$d/mb.json" ;; esac
  case $PARTS in *,store,*)
    kv 150 python3 -m kvarn_cli.app microbench store --batch 128 --context 2048 --q-heads 32 --kv-heads 8 \
      --head-dim 128 --model qwen3-8b --kv-dtype kvarn_k4v2_g128 --check --json 2>"$d/store.err" | tail -n 1 \
      > "$d/store.json"
    kv 120 python3 scripts/device/step_store.py > "$d/step_store.json" 2> "$d/step_store.err"
    kv 120 python3 scripts/device/step_store.py --mixed > "$d/step_mixed.json" 2> "$d/step_mixed.err" ;; esac
  case $PARTS in *,bench,*)
    # --timeout is per cell (engine start + burst); the wrapper allows every cell its own
    local cells; cells=$(echo "$dtypes" | tr ',' '\n' | wc -l)
    kv $(( 40 + 400 * cells )) python3 -m kvarn_cli.app bench --engine vllm --model qwen3-8b --dummy-weights \
      --kv-dtype "$dtypes" --burst 16k --requests 96 --prompt-len 14336 --output-len 2048 \
      --max-num-seqs 96 --timeout 380 --out "$d/bench" > "$d/bench.log" 2>&1 ;; esac
  bash "$(dirname "$0")/free_gpu.sh"
  case $PARTS in *,serve,*)
    local cells; cells=$(echo "$dtypes" | tr ',' '\n' | wc -l)
    kv $(( 40 + 240 * cells * SERVE_REPEAT )) python3 -m kvarn_cli.app bench --engine vllm --mode serve \
      --model qwen3-0.6b --dummy-weights --kv-dtype "$dtypes" --burst $(( SERVE_PROMPT + 256 )) \
      --prompt-len "$SERVE_PROMPT" --requests 32 --max-num-seqs 32 --gpu-memory-utilization 0.5 --timeout 230 \
      --repeat "$SERVE_REPEAT" --out "$d/serve" \
      > "$d/serve.log" 2>&1 ;; esac
  bash "$(dirname "$0")/free_gpu.sh"
  case $PARTS in *,ppl,*)
    kv 300 python3 -m kvarn_cli.app eval ppl --engine vllm --model smollm2-135m --weights "$SMOL" --context 4096 \
      --limit 2 --chunk 128 --kv-dtype auto,kvarn_k4v2_g128 --data .device/data/moby_dick.txt \
      --out "$d/eval" > "$d/ppl.log" 2>&1 ;; esac
  bash "$(dirname "$0")/free_gpu.sh"
}
[[ $SIDES == *,base,* ]] && side base /tmp/kvarn-base-site "${KVARN_BA_BASE_DTYPES:-auto,kvarn_k4v2_g128}"
[[ $SIDES == *,head,* ]] && side head "${KVARN_SITE:-/tmp/kvarn-site}" "${KVARN_BA_HEAD_DTYPES:-auto,kvarn_k4v2_g128}"
python3 - "$OUT" <<'PY'
import json, os, pathlib, sys
from kvarn.results import ResultsStore
root = pathlib.Path(sys.argv[1])
print(f"{'side':5} {'decode ms':>10} {'FA3 ms':>8} {'flush 1x36':>10} {'128x36 ms':>10} {'one-launch':>10} "
      f"{'FP16 tok/s':>11} {'KVarN tok/s':>12} {'ratio':>6} {'KV x':>5} {'ppl FP16':>9} {'ppl KVarN':>10}")
for side in ("base", "head"):
    d = root / side
    try:
        mb = json.loads((d / "mb.json").read_text())
    except Exception:  # noqa: BLE001 - a part not run or failed: its columns stay empty
        mb = {}
    try:
        st = json.loads((d / "store.json").read_text()).get("extra", {})
    except Exception:  # noqa: BLE001
        st = {}
    tok, kv, ppl = {}, {}, {}
    try:
        b = ResultsStore(d / "bench").read("bench")
        for r in b.to_dict("records"):
            tok[r["kv_dtype"]], kv[r["kv_dtype"]] = r.get("output_tok_s"), r.get("kv_tokens")
    except Exception:  # noqa: BLE001
        pass
    try:
        e = ResultsStore(d / "eval").read("eval")
        for r in e.to_dict("records"):
            ppl[r["kv_dtype"]] = r.get("ppl")
    except Exception:  # noqa: BLE001
        pass
    f = lambda x, p=1: "-" if x is None or x != x else f"{x:.{p}f}"  # noqa: E731
    ratio = tok.get("kvarn_k4v2_g128") / tok["auto"] if tok.get("auto") and tok.get("kvarn_k4v2_g128") else None
    kvx = kv.get("kvarn_k4v2_g128") / kv["auto"] if kv.get("auto") and kv.get("kvarn_k4v2_g128") else None
    print(f"{side:5} {f(mb.get('ms'), 4):>10} {f(mb.get('baseline_ms'), 4):>8} "
          f"{f(st.get('flush_ms_all_layers'), 3):>10} {f(st.get('batch_flush_ms_all_layers'), 3):>10} "
          f"{f(st.get('flush_layers_ms'), 3):>10} {f(tok.get('auto')):>11} "
          f"{f(tok.get('kvarn_k4v2_g128')):>12} {f(ratio, 2):>6} {f(kvx, 2):>5} {f(ppl.get('auto'), 3):>9} "
          f"{f(ppl.get('kvarn_k4v2_g128'), 3):>10}")
for name, what in (("step_store", "a prefill step's store"), ("step_mixed", "a mixed step's store + attention")):
    for side in ("base", "head"):
        try:
            r = json.loads((root / side / f"{name}.json").read_text())
            fa = " (FlashAttention)" if r["flash_attention"] else " (torch varlen: no vLLM)" if r["mixed"] else ""
            # host / GPU: the host's time to launch the step and the GPU's own time (an earlier script has neither)
            hg = "" if r.get("host_ms") is None else (f" (host {r['host_ms']:.3f}, GPU "
                                                      f"{'-' if r.get('gpu_ms') is None else format(r['gpu_ms'], '.3f')})")
            print(f"{side}: {what}{fa}, {r['requests']} rows, {r['tokens']} tokens x {r['layers']} layers "
                  f"({r['tiles']} tiles): {r['step_ms']:.3f} ms{hg}")
        except Exception:  # noqa: BLE001 - not run
            pass
serve = []
for side in ("base", "head"):
    try:
        serve += [(side, r) for r in ResultsStore(root / side / "serve").read("bench").to_dict("records")]
    except Exception:  # noqa: BLE001 - not run
        pass
if serve:
    print(f"\nserved, Qwen3-0.6B, 32 x ({int(os.environ.get('KVARN_BA_SERVE_PROMPT', 1024)):,} + 256)\n"
          f"{'side':5} {'kv dtype':16} {'r':>2} {'status':8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'start s':>8} {'compiles':>8} {'warm-up s':>9}")
    def rep(r):  # the repeat index; -1 where a row has none
        x = r.get("repeat")
        return -1 if x is None or x != x else int(x)
    for side, r in sorted(serve, key=lambda x: (x[0] != "base", str(x[1]["kv_dtype"]), rep(x[1]))):
        print(f"{side:5} {r['kv_dtype']:16} {rep(r):>2} {r['status']:8} "
              f"{f(r.get('output_tok_s')):>10} {f(r.get('ttft_ms_p50')):>9} {f(r.get('ttft_ms_p90')):>9} "
              f"{f(r.get('itl_ms_p50'), 2):>8} {f(r.get('itl_ms_p99'), 2):>8} {f(r.get('engine_start_s')):>8} "
              f"{f(r.get('start_jit_compiles'), 0):>8} {f(r.get('start_kvarn_warmup_s')):>9}")
PY
