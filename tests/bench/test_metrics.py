"""kvarn.bench.metrics: the KV-cache pool recovered from the capacity vLLM prints."""
from tests.bench.helpers import vllm_logged_tokens


def test_pool_blocks_from_logged_tokens_inverts_vllms_rounding():
    from kvarn.bench.metrics import pool_blocks_from_log

    # an H200 run: Qwen3-8B shape, kvarn_k4v2_g128, 16 x (2,048 + 64), vLLM printed 3,397,338 for 27,346 blocks
    assert vllm_logged_tokens(27_346, 2112, 128) == 3_397_338
    assert pool_blocks_from_log(3_397_338, 2112, 128) == 27_346
    # whole-block lengths where the float product lands just below the integer: 61 blocks at 112 print 975, not 976
    assert vllm_logged_tokens(61, 112, 16) == 975 and pool_blocks_from_log(975, 112, 16) == 61
    for blocks in (1, 7, 61, 1000, 27_345, 27_346, 49_487, 250_001):
        for length, block in ((2112, 128), (16384, 128), (4000, 128), (1000, 16), (2112, 16), (100, 64)):
            assert pool_blocks_from_log(vllm_logged_tokens(blocks, length, block), length, block) == blocks
