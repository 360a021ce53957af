#!/usr/bin/env bash
# The whole `pytest -m gpu` selection plus a vLLM smoke, ending in one line:
#   gpu tests: N passed, M failed; vllm smoke: ok|failed
# Needs the vLLM bundle (run.sh stages it and installs kvarn), so it runs as a part of scripts/device/run.sh:
#   KVARN_BG=1 bash scripts/device/run.sh gpusuite:1500      # the whole selection: longer than one 10-minute call,
#   bash scripts/device/run.sh wait:540                      # so it runs in the background; `wait` (again) collects it
#   bash scripts/device/run.sh gpusuite:590@KVARN_GPUSUITE_FILES=tests/vllm_plugin/test_vllm_gpu.py   # a part of it in one call
# Each test file's tests run in their own pytest processes (shards, all at once): a CUDA error that poisons its
# process (an illegal memory access) fails that shard's later tests, which count as failed, but cannot fail the other
# shards'. A shard cut by the time limit or dead before writing its results is counted apart ("shards not run"), never
# as passed, and makes the exit status non-zero.
#   KVARN_GPUSUITE_FILES  test files to run (default: every file with a test the gpu marker selects)
#   KVARN_GPUSUITE_SHARDS pytest processes per file (default 4)
#   KVARN_SMOKE_CASES     vllm_smoke.sh cases (default: SmolLM2 FP16 and the shipped KVarN preset, eager, and that preset
#                         with CUDA graphs)
#   KVARN_SMOKE_BUDGET    seconds for the smoke (default 300), kept out of the part's time limit before the tests
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/gpusuite"
DIR="$(cd "$(dirname "$0")" && pwd)"
T0=$(date +%s)
LIMIT="${KVARN_PART_SECS:-590}"
export KVARN_SMOKE_BUDGET="${KVARN_SMOKE_BUDGET:-300}"
export KVARN_SMOKE_CASES="${KVARN_SMOKE_CASES:-smol_fp16_eager_v2,smol_g128_eager_v2,smol_g128_graph_v2}"
TESTS_END=$(( T0 + LIMIT - KVARN_SMOKE_BUDGET - 20 ))   # the smoke keeps its share of the part's time
smoke="not run"
not_run=()

summary() {  # counts from the JUnit files written so far: the line is printed even when the part is cut short
  python3 - "$OUT/gpusuite" "$smoke" "${#not_run[@]}" <<'PY'
import glob, sys
import xml.etree.ElementTree as ET
root, smoke, not_run = sys.argv[1], sys.argv[2], int(sys.argv[3])
passed = failed = errors = skipped = 0
for f in sorted(glob.glob(f"{root}/*.xml")):
    try:
        suites = ET.parse(f).getroot()
    except ET.ParseError:  # a process killed while writing: its file says nothing, count it as not run
        not_run += 1
        continue
    for s in ([suites] if suites.tag == "testsuite" else suites.iter("testsuite")):
        n, fl, er, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        passed += n - fl - er - sk
        failed += fl
        errors += er
        skipped += sk
extra = [f"{what}: {n}" for n, what in ((errors, "errors"), (skipped, "skipped"), (not_run, "shards not run")) if n]
print(f"gpu tests: {passed} passed, {failed + errors} failed; vllm smoke: {smoke}"
      + (f" ({', '.join(extra)})" if extra else ""))
sys.exit(0 if passed and not (failed or errors or not_run) and smoke == "ok" else 1)
PY
}
# children run in the background and are waited for, so a TERM from run.sh's time limit reaches this trap at once
CHILD=""
bg() {  # LOG CMD...
  local log="$1"; shift
  "$@" > "$log" 2>&1 & CHILD=$!
  wait "$CHILD"; local rc=$?; CHILD=""; return $rc
}
declare -A JOB_PID=()
stopped() {
  [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null
  for j in "${!JOB_PID[@]}"; do kill -TERM "${JOB_PID[$j]}" 2>/dev/null && not_run+=("$j (stopped)"); done
  [ "$smoke" = "not run" ] || [ "$smoke" = running ] && smoke="cut by the time limit"
  echo "=== the part was stopped"; summary; exit 124
}
trap stopped TERM INT

IDS="$OUT/gpusuite/ids"; mkdir -p "$IDS"
collect() {  # PATH: the node ids the gpu marker selects there
  python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider "$1" 2>/dev/null | grep '::'
}
if [ -n "${KVARN_GPUSUITE_FILES:-}" ]; then
  read -r -a files <<< "$KVARN_GPUSUITE_FILES"
  # one collection per named file: a path pytest cannot find fails its own file only
  for f in "${files[@]}"; do collect "$f" > "$IDS/$(basename "$f" .py)"; done
else
  # what the marker selects, and every file that names the marker: one whose collection fails still runs (and
  # counts as failed) instead of dropping out of the selection
  collect tests > "$IDS/all"
  mapfile -t files < <({ cut -d: -f1 "$IDS/all"; find tests -name 'test_*.py' -exec grep -l -E 'mark\.gpu' {} +; } \
                       | sort -u)
  # one collection serves every file: its node ids, in collection order, go to the file they name
  for f in "${files[@]}"; do awk -F'::' -v f="$f" '$1 == f' "$IDS/all" > "$IDS/$(basename "$f" .py)"; done
fi
echo "gpu test files: ${files[*]:-none}"
# The time goes to Triton compiles (CPU) far more than to the GPU: each file's tests are dealt round-robin into up to
# KVARN_GPUSUITE_SHARDS pytest processes (default 4), and every process runs at once
SHARDS="${KVARN_GPUSUITE_SHARDS:-4}"
jobs_=()
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  n=$(wc -l < "$IDS/$name")
  if [ "$n" -eq 0 ]; then  # nothing collected (a collection error): the file runs whole, and its error is counted
    echo "$f" > "$IDS/$name.0"; jobs_+=("$name.0"); continue
  fi
  k=$(( n < SHARDS ? n : SHARDS ))
  for ((i = 0; i < k; i++)); do
    awk -v k="$k" -v i="$i" 'NR % k == i' "$IDS/$name" > "$IDS/$name.$i"; jobs_+=("$name.$i")
  done
done
left=$(( TESTS_END - $(date +%s) ))
for j in "${jobs_[@]}"; do
  mapfile -t ids < "$IDS/$j"
  echo "--- $j: ${#ids[@]} test(s) (at most ${left} s)"
  timeout -k 5 "$left" python3 -m pytest -m gpu "${ids[@]}" -p no:cacheprovider -q -rfE --tb=short \
    --junitxml="$OUT/gpusuite/$j.xml" > "$OUT/gpusuite/$j.log" 2>&1 &
  JOB_PID[$j]=$!
done
for j in "${jobs_[@]}"; do
  wait "${JOB_PID[$j]}"; rc=$?; unset "JOB_PID[$j]"
  echo "--- $j: exit $rc"; tail -n 4 "$OUT/gpusuite/$j.log"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then  # cut: the finished tests are lost with the unwritten XML
    rm -f "$OUT/gpusuite/$j.xml"; not_run+=("$j (cut after ${left} s)")
  elif [ ! -s "$OUT/gpusuite/$j.xml" ]; then  # the process died (e.g. a CUDA abort) before writing its results
    not_run+=("$j (no result: exit $rc, see gpusuite/$j.log)")
  fi
done
bash "$DIR/free_gpu.sh" > /dev/null 2>&1
[ ${#not_run[@]} -gt 0 ] && printf 'not run: %s\n' "${not_run[@]}"

echo "--- vLLM smoke: $KVARN_SMOKE_CASES"
smoke=running
bg "$OUT/gpusuite/smoke.log" env OUT="$OUT/gpusuite/smoke" bash "$DIR/vllm_smoke.sh"
tail -n 8 "$OUT/gpusuite/smoke.log"
smoke=ok
IFS=, read -r -a cases <<< "$KVARN_SMOKE_CASES"
for c in "${cases[@]}"; do
  if ! python3 -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get('ok') is True else 1)" \
      "$OUT/gpusuite/smoke/$c.json" 2>/dev/null; then
    smoke=failed; echo "smoke case $c: not ok (log: gpusuite/smoke/$c.log)"
  fi
done
trap - TERM INT
echo "=== $(( $(date +%s) - T0 )) s"
summary   # exit 0 only when every selected test ran and passed and the smoke is ok
