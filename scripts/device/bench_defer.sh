#!/usr/bin/env bash
# bench.sh with KVARN_DEFER_FLUSH=1, as a part of its own, so one lane runs the deferred flush's A/B on one GPU:
#   KVARN_BENCH_KV=kvarn_k4v2_g128 KVARN_BENCH_SHAPE="..." bash scripts/device/run.sh bench:330 bench_defer:330
# (the flag is in the cell's backend_env, so its configuration hash differs and the second part does not resume
# from the first one's row)
KVARN_DEFER_FLUSH=1 exec bash "$(dirname "$0")/bench.sh"
