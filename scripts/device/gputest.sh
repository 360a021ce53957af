#!/usr/bin/env bash
# The GPU-marked kernel tests that guard the vLLM decode path (compiled Triton, CUDA-graph capture), failures shown
# in full. Part of scripts/device/run.sh: bash scripts/device/run.sh gputest:300 (the default selection, 42 tests,
# ran past 180 s on a fresh machine in session 10: its first calls compile every kernel variant). The whole
# `pytest -m gpu` selection plus a vLLM smoke, with one summary line: scripts/device/gpusuite.sh
set -uo pipefail
# no pipe: a part cut by its time limit still leaves every finished test's line in the log (-v, one per test)
# KVARN_GPUTEST_FILES: other test files, e.g. tests/vllm_plugin/test_vllm_plugin_warmup.py (with KVARN_GPUTEST_K=warm_up)
read -r -a files <<< "${KVARN_GPUTEST_FILES:-tests/kernels/test_kernels_gpu.py}"
python3 -m pytest -v -m gpu "${files[@]}" -p no:cacheprovider -rf --tb=short --durations=8 \
  -k "${KVARN_GPUTEST_K:-self_checks or cuda_graph or store_matches or store_decode or dequantize or dense or flush_layers or defer or (decode_matches and 128-32-8) or (prefill and dtype1-kvarn_k4v2_g128)}" \
  2>&1
