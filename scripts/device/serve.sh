#!/usr/bin/env bash
# bench.sh's serve-mode check as a part of its own, so one lane can run it beside an offline bench part:
#   bash scripts/device/run.sh serve:480 bench:900   (FP16 ~130 s; a first KVarN start compiles, up to 300 s)
# `vllm serve` imports modules the device bundle lacks (the offline engine does not): carry them as wheels in
# .device/data, which run.sh installs, made here once by
#   pip download --no-deps uvicorn model-hosting-container-standards jmespath python-multipart -d .device/data
KVARN_BENCH_PART=serve exec bash "$(dirname "$0")/bench.sh"
