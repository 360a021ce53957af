#!/usr/bin/env bash
# bench.sh with KVARN_DEFER_FLUSH=1 (the default since session 19, so the same cells as bench; the A/B now is
# bench:330@KVARN_DEFER_FLUSH=0), kept for the earlier sessions' commands, as a part of its own:
#   KVARN_BENCH_KV=kvarn_k4v2_g128 KVARN_BENCH_SHAPE="..." bash scripts/device/run.sh bench:330@KVARN_DEFER_FLUSH=0 \
#     bench_defer:330
# (the flag is in the cell's backend_env, so the two cells' configuration hashes differ and neither resumes the other)
KVARN_DEFER_FLUSH=1 exec bash "$(dirname "$0")/bench.sh"
