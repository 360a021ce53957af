#!/usr/bin/env bash
# bench.sh's serve-mode check as a part of its own, so one lane can run it beside an offline bench part:
#   bash scripts/device/run.sh serve:300 bench:900
KVARN_BENCH_PART=serve exec bash "$(dirname "$0")/bench.sh"
