#!/usr/bin/env bash
# A declarative suite (`kvarn suite run`) on the lent GPU, resumable across calls and machines:
#   KVARN_BG=1 bash scripts/device/run.sh suite:1500@KVARN_SUITE=readme    then   bash scripts/device/run.sh wait:560
# Results go to /tmp/suite-NAME (kept while the machine stays warm: a later call resumes there) and come back in
# $OUT/logs.tar.xz as suite-NAME/; unpack them into .device/suite-NAME and carry that folder to resume on a fresh
# machine (finished cells are skipped; a step cut short reruns its FP16 cell with the candidates still to do, so no
# ratio pairs cells of two calls). Prints the suite's table last (`kvarn results --table readme` for the readme suite).
#   KVARN_SUITE       suites/NAME.yaml (default readme)
#   KVARN_SUITE_ONLY  bench or eval: only those steps
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false COLUMNS=220
NAME="${KVARN_SUITE:-readme}"
RES=/tmp/suite-$NAME
KVARN="kvarn"; command -v kvarn >/dev/null 2>&1 || KVARN="python3 -m kvarn_cli.app"
mkdir -p "$RES"
[ -d ".device/suite-$NAME" ] && cp -rn ".device/suite-$NAME/." "$RES/"
$KVARN suite run "$NAME" --out "$RES" ${KVARN_SUITE_ONLY:+--only "$KVARN_SUITE_ONLY"} --dry-run 2>&1 | tail -n 12
# the part's own limit ends this run (TERM): the suite's process group (its bench and engines) is ended and waited
# for, then the store is copied out; what finished is in it, the cell that was running reruns next time
pid=
stop() {
  [ -n "$pid" ] && { kill -TERM -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }
  bash "$(dirname "$0")/free_gpu.sh"
}
trap stop TERM
setsid $KVARN suite run "$NAME" --out "$RES" ${KVARN_SUITE_ONLY:+--only "$KVARN_SUITE_ONLY"} \
  > "$OUT/suite-$NAME.log" 2>&1 &
pid=$!
wait "$pid"; rc=$?
echo "kvarn suite run $NAME rc=$rc"
mkdir -p "$OUT/suite-$NAME" && cp -r "$RES/." "$OUT/suite-$NAME/"
if [ "$NAME" = readme ]; then $KVARN results "$RES" --table readme 2>&1 | tail -n 30
else $KVARN results "$RES" --kind bench 2>&1 | tail -n 30; fi
