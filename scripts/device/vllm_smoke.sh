#!/usr/bin/env bash
# KVarN on stock vLLM 0.26: end-to-end smoke on the lent H200.
#   PYTHONPATH=/tmp/kvarn-site:/tmp/site (vLLM 0.26 + kvarn installed), model at /tmp/models/smollm2-135m-instruct.
#   As a part of scripts/device/run.sh:  KVARN_PART_TIMEOUT=420 bash scripts/device/run.sh vllm_smoke
# Stages (each engine in its own process with a timeout; a failure never stops the run):
#   0 plugin/CLI checks (no engine), kernels-vs-torch ops check on the GPU
#   1 SmolLM2 fp16 eager MRv2 (baseline: chunked-prefill perplexity, greedy tokens)
#   2 SmolLM2 kvarn_k4v2_g128: eager MRv2, eager MRv1, CUDA graphs MRv2 (full-graph decode), CUDA graphs MRv1
#   3 Qwen3-8B shape, dummy weights, CUDA graphs: FP16's and kvarn_k4v2_g128's KV capacity as vLLM reports it
#     (>= 4.4x), and a 16 x (4096 + 128) burst on KVarN
#   4 the other presets (g64, k4v4, k2v2), a preemption run, a prefix-cache-hit check
# Logs: $OUT/<case>.log (full vLLM log), $OUT/<case>.json (results), $OUT/smoke_summary.txt. Last: a table, with a
# KV ratio only against the FP16 case of the same model and runner / graph mode in the same call.
# A/B of a backend knob (token ids compared in full, e.g. the deferred flush under preemption):
#   bash scripts/device/run.sh vllm_smoke:150@KVARN_SMOKE_CASES=smol_g128_preempt \
#     vllm_smoke:150@KVARN_DEFER_FLUSH=0,KVARN_SMOKE_TAG=nodefer,KVARN_SMOKE_CASES=smol_g128_preempt
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
BUDGET="${KVARN_SMOKE_BUDGET:-390}"   # seconds for the whole script (engines are skipped once it is spent)
CASE_TIMEOUT="${KVARN_CASE_TIMEOUT:-150}"
SMOL="${KVARN_SMOL:-/tmp/models/smollm2-135m-instruct}"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "[smoke +$(( $(date +%s) - T0 ))s] $*"; }
free_gpu() { bash "$(dirname "$0")/free_gpu.sh"; sleep 1; }

# ---- the per-engine driver ------------------------------------------------------------------------------------
cat > "$OUT/kvarn_case.py" <<'PY'
import json, math, os, sys, time
cfg = json.loads(sys.argv[1]); out_json = sys.argv[2]
res = {"case": cfg["case"], "ok": False, "tag": os.environ.get("KVARN_SMOKE_TAG", "")}
def save():
    with open(out_json, "w") as f: json.dump(res, f, indent=1)
t0 = time.time()
try:
    from vllm import LLM, SamplingParams
    kw = dict(model=cfg["model"], dtype=cfg.get("dtype", "float16"), kv_cache_dtype=cfg["kv"],
              enforce_eager=cfg.get("eager", True), gpu_memory_utilization=cfg.get("util", 0.35),
              max_model_len=cfg.get("max_model_len", 4096), seed=0)
    for k in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override", "load_format",
              "skip_tokenizer_init", "enable_chunked_prefill", "enable_prefix_caching"):
        if k in cfg: kw[k] = cfg[k]
    if "preempt" in cfg.get("tasks", []):
        kw["disable_log_stats"] = False  # get_metrics() asserts stat logging: the preemption count proves the case
    print("[case] LLM kwargs:", kw, flush=True)
    llm = LLM(**kw)
    res["start_s"] = round(time.time() - t0, 1)
    vc = llm.llm_engine.vllm_config; cc = vc.cache_config
    res.update(num_gpu_blocks=cc.num_gpu_blocks, block_size=cc.block_size,
               kv_tokens=getattr(cc, "kv_cache_size_tokens", None) or (cc.num_gpu_blocks or 0) * cc.block_size,
               max_num_seqs=vc.scheduler_config.max_num_seqs, cache_dtype=cc.cache_dtype,
               cudagraph_mode=str(vc.compilation_config.cudagraph_mode))
    print(f"[case] cache: {res}", flush=True); save()
    tasks = cfg.get("tasks", [])
    if "ppl" in tasks:
        tok = llm.get_tokenizer()
        try:
            from kvarn.method.textdata import load_text; text = load_text()
        except Exception:
            text = open(os.path.join(cfg["repo"], "kvarn", "data", "moby_dick.txt")).read()
        ids = tok(text)["input_ids"]; W = cfg.get("window", 2048)
        wins = [ids[i:i + W] for i in range(0, len(ids) - W + 1, W)][: cfg.get("windows", 2)]
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        t = time.time(); outs = llm.generate([{"prompt_token_ids": w} for w in wins], sp, use_tqdm=False)
        nll, n = 0.0, 0
        for w, o in zip(wins, outs):
            for pos, lp in enumerate(o.prompt_logprobs):
                if lp is None: continue
                nll -= lp[w[pos]].logprob; n += 1
        res.update(ppl=math.exp(nll / n), ppl_tokens=n, ppl_s=round(time.time() - t, 1))
        print(f"[case] chunked-prefill perplexity {res['ppl']:.4f} over {n} tokens ({len(wins)} windows)", flush=True)
        save()
    if "gen" in tasks:
        prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Call me Ishmael. Some years ago",
                   "The three primary colors are", "In 1969, the first person to walk on the moon was",
                   "A haiku about the sea:\n"]
        tok = llm.get_tokenizer()
        long = tok.decode(tok(open(os.path.join(cfg["repo"], "kvarn", "data", "moby_dick.txt")).read())["input_ids"][:300])
        prompts.append(long)  # > 2 tiles: exercises continuation chunks / decode over records
        sp = SamplingParams(max_tokens=cfg.get("gen_tokens", 48), temperature=0.0)
        t = time.time(); outs = llm.generate(prompts, sp, use_tqdm=False)
        res["gen_s"] = round(time.time() - t, 1)
        res["gen_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        res["gen_text"] = [o.outputs[0].text[:80] for o in outs]
        for p, o in zip(prompts, outs): print(f"[case] gen {p[:30]!r} -> {o.outputs[0].text[:70]!r}", flush=True)
        if "prefix" in tasks:  # the same long prompt again: a prefix-cache hit over quantized tiles
            again = llm.generate([long], sp, use_tqdm=False)[0].outputs[0].token_ids
            res["prefix_hit_same"] = list(again) == res["gen_ids"][-1]
            print(f"[case] prefix-hit rerun identical: {res['prefix_hit_same']}", flush=True)
        save()
    if "burst" in tasks:
        import random
        rnd = random.Random(0); n, L, G = cfg.get("burst_n", 16), cfg.get("burst_in", 4096), cfg.get("burst_out", 128)
        prompts = [{"prompt_token_ids": [rnd.randrange(100, 30000) for _ in range(L)]} for _ in range(n)]
        sp = SamplingParams(max_tokens=G, ignore_eos=True, detokenize=False, temperature=0.0)
        t = time.time(); outs = llm.generate(prompts, sp, use_tqdm=False); dt = time.time() - t
        done = sum(len(o.outputs[0].token_ids) == G for o in outs)
        res.update(burst_s=round(dt, 1), burst_done=done, burst_tok_s=round(n * (L + G) / dt))
        print(f"[case] burst {n}x({L}+{G}): {done}/{n} complete in {dt:.1f}s, {n*(L+G)/dt:.0f} total tok/s", flush=True)
    if "preempt" in tasks:
        tok = llm.get_tokenizer()
        base = tok(open(os.path.join(cfg["repo"], "kvarn", "data", "moby_dick.txt")).read())["input_ids"]
        prompts = [{"prompt_token_ids": base[i * 500:i * 500 + 400]} for i in range(8)]
        sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        t = time.time(); outs = llm.generate(prompts, sp, use_tqdm=False)
        res.update(preempt_s=round(time.time() - t, 1), preempt_done=sum(len(o.outputs[0].token_ids) == 200 for o in outs),
                   preempt_text=[o.outputs[0].text[:60] for o in outs[:2]],
                   preempt_ids=[list(o.outputs[0].token_ids) for o in outs])  # compared in full across tagged runs
        try:  # the bench cell's reading of vLLM's counter (its name differs across versions)
            from kvarn.bench.engines.vllm_cell import metric_values, preemption_count
            res["num_preemptions"] = preemption_count(metric_values(llm.get_metrics()))
        except Exception as e:
            res["num_preemptions"] = f"n/a ({type(e).__name__})"
        print(f"[case] preemption run: {res['preempt_done']}/8 complete, preemptions={res['num_preemptions']}", flush=True)
    res["ok"] = True
except BaseException as e:
    import traceback; traceback.print_exc()
    res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
res["total_s"] = round(time.time() - t0, 1); save()
print("[case] done", json.dumps({k: v for k, v in res.items() if k not in ("gen_ids", "gen_text")}), flush=True)
os._exit(0 if res["ok"] else 1)
PY

run_case() {  # name, env-prefix ("" or VAR=val ...), json config
  local name="$1" envs="$2" cfg="$3" rem
  # KVARN_SMOKE_CASES=name,name: only these cases (e.g. smol_g128_preempt in a short call); empty: all
  if [ -n "${KVARN_SMOKE_CASES:-}" ] && [[ ",$KVARN_SMOKE_CASES," != *",$name,"* ]]; then return; fi
  # KVARN_SMOKE_TAG=t: an A/B's second run (e.g. with KVARN_DEFER_FLUSH=1) keeps its own files, <case>@t.*, beside the
  # first run's in the same $OUT, and the table compares its token ids with the untagged run's in full
  name="$name${KVARN_SMOKE_TAG:+@$KVARN_SMOKE_TAG}"
  rem=$(left)
  if [ "$rem" -lt 45 ]; then log "SKIP $name (budget spent)"; echo "{\"case\":\"$name\",\"skipped\":true}" > "$OUT/$name.json"; return; fi
  local to=$(( rem < CASE_TIMEOUT ? rem : CASE_TIMEOUT ))
  log "START $name (timeout ${to}s) env=[$envs] cfg=$cfg"
  env $envs timeout -k 5 "$to" python3 "$OUT/kvarn_case.py" "$cfg" "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  log "END $name rc=$rc"
  grep -E "GPU KV cache size|Maximum concurrency|kvarn:|\[case\]|Error|error:" "$OUT/$name.log" | grep -v "^\s*$" | tail -n 14 | sed 's/^/    /'
  [ $rc -ne 0 ] && { echo "    --- last lines:"; tail -n 12 "$OUT/$name.log" | sed 's/^/    /'; }
  echo "$rc" > "$OUT/$name.rc"
  free_gpu
}

# ---- stage 0: no engine --------------------------------------------------------------------------------------
if [ -z "${KVARN_SMOKE_CASES:-}" ]; then  # stage 0 only in a full run
log "stage 0: versions, entry point, dtype patching, CLI parsers"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
timeout 90 python3 - > "$OUT/stage0.log" 2>&1 <<'PY'
import importlib.metadata as md, typing
import vllm, torch, triton
print("vllm", vllm.__version__, "torch", torch.__version__, "triton", triton.__version__)
eps = [e for e in md.entry_points(group="vllm.general_plugins")]
print("general_plugins:", [(e.name, e.value) for e in eps])
from vllm.plugins import load_general_plugins; load_general_plugins()
import kvarn.vllm_plugin as p; print("plugin state:", p.state())
from vllm.config.cache import CacheConfig, CacheDType
print("Literal has kvarn:", [n for n in typing.get_args(CacheDType) if n.startswith("kvarn")])
print("CacheConfig ok:", CacheConfig(cache_dtype="kvarn_k4v2_g128", block_size=128).cache_dtype)
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.engine.arg_utils import AsyncEngineArgs
ap = FlexibleArgumentParser(); AsyncEngineArgs.add_cli_args(ap)
a = ap.parse_args(["--model", "x", "--kv-cache-dtype", "kvarn_k4v2_g128", "--block-size", "128"])
print("serve-style CLI parse ok:", a.kv_cache_dtype, a.block_size)
from vllm.benchmarks import throughput
bp = FlexibleArgumentParser(); throughput.add_cli_args(bp)
b = bp.parse_args(["--model", "x", "--kv-cache-dtype", "kvarn_k4v2_g128", "--block-size", "128", "--input-len", "8", "--output-len", "8"])
print("bench throughput CLI parse ok:", b.kv_cache_dtype)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
print("CUSTOM ->", AttentionBackendEnum.CUSTOM.get_path())
import vllm.platforms.cuda as c; print("routing:", c._get_backend_priorities(False, None, 9, "kvarn_k4v2_g128"))
PY
echo "    stage0 rc=$?"; sed 's/^/    /' "$OUT/stage0.log" | tail -n 14
log "stage 0b: kernels-vs-torch ops on the GPU (also warms the Triton cache)"
timeout 120 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/vllm_plugin/test_vllm_gpu.py -k "ops" > "$OUT/gpu_ops.log" 2>&1
echo "    gpu ops tests rc=$?"; tail -n 6 "$OUT/gpu_ops.log" | sed 's/^/    /'
fi

REPO="$(pwd)"
S='"model":"'$SMOL'","repo":"'$REPO'","max_num_seqs":16,"enable_chunked_prefill":true,"max_num_batched_tokens":128,"tasks":["ppl","gen","prefix"]'
# ---- stage 1-2: SmolLM2 ----------------------------------------------------------------------------------------
run_case smol_fp16_eager_v2  ""                            '{"case":"smol_fp16_eager_v2","kv":"auto",'"$S"'}'
run_case smol_g128_eager_v2  ""                            '{"case":"smol_g128_eager_v2","kv":"kvarn_k4v2_g128","block_size":128,'"$S"'}'
run_case smol_g128_eager_v1  "VLLM_USE_V2_MODEL_RUNNER=0"  '{"case":"smol_g128_eager_v1","kv":"kvarn_k4v2_g128","block_size":128,'"$S"'}'
run_case smol_g128_graph_v2  ""                            '{"case":"smol_g128_graph_v2","kv":"kvarn_k4v2_g128","block_size":128,"eager":false,'"$S"'}'
# ---- stage 3: Qwen3-8B shape -----------------------------------------------------------------------------------
QDIR=/tmp/models/qwen3-8b-dummy; mkdir -p "$QDIR"; cp suites/models/qwen3-8b.json "$QDIR/config.json"
Q='"model":"'$QDIR'","repo":"'$REPO'","load_format":"dummy","skip_tokenizer_init":true,"util":0.9,"max_model_len":8192'
run_case qwen8b_fp16_graph_v2 ""                           '{"case":"qwen8b_fp16_graph_v2","kv":"auto","eager":false,'"$Q"'}'
run_case qwen8b_g128_graph_v2 ""                           '{"case":"qwen8b_g128_graph_v2","kv":"kvarn_k4v2_g128","block_size":128,"eager":false,"tasks":["burst"],'"$Q"'}'
# ---- stage 4: more runners / presets / preemption --------------------------------------------------------------
run_case smol_g128_graph_v1  "VLLM_USE_V2_MODEL_RUNNER=0"  '{"case":"smol_g128_graph_v1","kv":"kvarn_k4v2_g128","block_size":128,"eager":false,'"$S"'}'
run_case smol_g64_eager_v2   ""                            '{"case":"smol_g64_eager_v2","kv":"kvarn_k4v2_g64","block_size":64,'"$S"'}'
run_case smol_k4v4_eager_v2  ""                            '{"case":"smol_k4v4_eager_v2","kv":"kvarn_k4v4_g128","block_size":128,'"$S"'}'
run_case smol_k2v2_eager_v2  ""                            '{"case":"smol_k2v2_eager_v2","kv":"kvarn_k2v2_g128","block_size":128,'"$S"'}'
run_case smol_g128_preempt   ""                            '{"case":"smol_g128_preempt","kv":"kvarn_k4v2_g128","block_size":128,"model":"'$SMOL'","repo":"'$REPO'","num_gpu_blocks_override":24,"max_num_seqs":8,"max_model_len":1024,"tasks":["preempt"]}'
run_case qwen8b_g128_eager_v1 "VLLM_USE_V2_MODEL_RUNNER=0" '{"case":"qwen8b_g128_eager_v1","kv":"kvarn_k4v2_g128","block_size":128,"eager":true,"tasks":["burst"],'"$Q"'}'

# ---- the table -------------------------------------------------------------------------------------------------
python3 - "$OUT" > "$OUT/smoke_summary.txt" <<'PY'
import glob, json, os, sys
out = sys.argv[1]; rows = {}
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    try: r = json.load(open(f))
    except Exception: continue
    if "case" in r: rows[r["case"] + (f"@{r['tag']}" if r.get("tag") else "")] = r
base = rows.get("smol_fp16_eager_v2", {})
def fp16_of(name):  # the FP16 case of the same model and runner / graph mode ("smol_g128_graph_v2" -> "smol_fp16_graph_v2")
    parts = name.split("@")[0].split("_", 2)
    return rows.get(f"{parts[0]}_fp16_{parts[2]}", {}) if len(parts) == 3 else {}
def agree(a, b):
    if not a or not b: return ""
    firsts = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        firsts.append(k)
    return f"{sum(f >= 8 for f in firsts)}/{len(firsts)} first8, mean {sum(firsts)/len(firsts):.0f}"
print(f"{'case':24} {'ok':4} {'start':>6} {'KV tokens':>11} {'vs fp16':>7} {'ppl':>8} {'d ppl':>7} {'greedy vs fp16':>22} note")
for name, r in rows.items():
    if r.get("skipped"): print(f"{name:24} SKIP"); continue
    kv = r.get("kv_tokens") or 0
    fp16_kv = fp16_of(name).get("kv_tokens")
    ref = f"{kv / fp16_kv:.2f}x" if kv and fp16_kv else ""
    ppl = r.get("ppl"); dp = f"{100 * (ppl / base['ppl'] - 1):+.2f}%" if ppl and base.get("ppl") else ""
    note = []
    if "burst_done" in r: note.append(f"burst {r['burst_done']}/16 {r['burst_s']}s {r['burst_tok_s']} tok/s")
    if "prefix_hit_same" in r: note.append(f"prefix-rerun same={r['prefix_hit_same']}")
    if "preempt_done" in r: note.append(f"preempt {r['preempt_done']}/8 n={r.get('num_preemptions')}")
    if r.get("cudagraph_mode"): note.append(r["cudagraph_mode"].replace("CUDAGraphMode.", "cg="))
    if r.get("error"): note.append("ERR " + r["error"][:90])
    first = rows.get(name.split("@")[0]) if "@" in name else None  # the A/B's untagged run of this case
    for key in ("gen_ids", "preempt_ids"):
        if first and r.get(key) and first.get(key):
            same = sum(x == y for x, y in zip(r[key], first[key]))
            note.append(f"{key} = untagged run's: {same}/{len(r[key])}")
    print(f"{name:24} {str(r.get('ok')):4} {str(r.get('start_s','')):>6} {kv:>11,} {ref:>7} "
          f"{(f'{ppl:.3f}' if ppl else ''):>8} {dp:>7} {agree(r.get('gen_ids'), base.get('gen_ids')) if name != 'smol_fp16_eager_v2' else '':>22} {'; '.join(note)}")
PY
log "done"
echo "=== vLLM 'GPU KV cache size' per case"
for f in "$OUT"/*.log; do n=$(basename "$f" .log); l=$(grep -m1 "GPU KV cache size" "$f" | sed 's/.*GPU KV cache size/GPU KV cache size/'); [ -n "$l" ] && echo "  $n: $l"; done
echo "=== summary"
cat "$OUT/smoke_summary.txt"
