#!/usr/bin/env bash
# Issue 4's acceptance step alone (the first step of kernels.sh, with room for a fresh machine's compiles): the
# default decode kernel and vLLM's FlashAttention 3 at B=64 x 16K, 32/8 heads, D=128, kvarn_k4v2_g128, timed from
# CUDA graphs in each order (--timing all: in turn, blocks, in turn with idle gaps; SM clock after each replay),
# checked against the reference; then the Qwen3-32B step. Needs the vLLM bundle (else SDPA).
# KVARN_ACCEPT_CONFIG=NAME: that decode config instead of the default (kvarn microbench decode --config).
set -u
KVARN="kvarn"; command -v kvarn >/dev/null 2>&1 || KVARN="python3 -m kvarn_cli.app"
export PYTHONUNBUFFERED=1 KVARN_AUTOTUNE=0
CFG=${KVARN_ACCEPT_CONFIG:+--config $KVARN_ACCEPT_CONFIG}
$KVARN microbench decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 \
  --kv-dtype kvarn_k4v2_g128 --check --timing all $CFG
$KVARN microbench decode --batch 128 --context 4096 --q-heads 64 --kv-heads 8 --head-dim 128 \
  --kv-dtype kvarn_k4v2_g128 --check --timing all $CFG
# the same in longer bursts (36 calls per graph: one Qwen3-8B step's layers): session 16 read 0.385x there
$KVARN microbench decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 \
  --kv-dtype kvarn_k4v2_g128 --graph-calls 36 --timing all $CFG
