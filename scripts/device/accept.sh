#!/usr/bin/env bash
# The decode acceptance step alone (the first step of kernels.sh, with room for a fresh machine's compiles): the
# decode kernel and vLLM's FlashAttention 3 at B=64 x 16K, 32/8 heads, D=128, kvarn_k4v2_g128, timed from
# CUDA graphs in each order (--timing all: in turn, blocks, in turn with idle gaps; SM clock after each replay),
# checked against the reference; then the Qwen3-32B step. Needs the vLLM bundle (else SDPA).
set -u
KVARN="kvarn"; command -v kvarn >/dev/null 2>&1 || KVARN="python3 -m kvarn_cli.app"
export PYTHONUNBUFFERED=1
$KVARN microbench decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 \
  --kv-dtype kvarn_k4v2_g128 --check --timing all
$KVARN microbench decode --batch 128 --context 4096 --q-heads 64 --kv-heads 8 --head-dim 128 \
  --kv-dtype kvarn_k4v2_g128 --check --timing all
# the same in longer bursts (36 calls per graph: one Qwen3-8B step's layers; a longer hot burst lowers the SM clock)
$KVARN microbench decode --batch 64 --context 16384 --q-heads 32 --kv-heads 8 --head-dim 128 \
  --kv-dtype kvarn_k4v2_g128 --graph-calls 36 --timing all
