"""One decode_attention call per config at issue 4's shape, inside a cudaProfilerStart/Stop range, for ncu
(scripts/device/ncu.sh runs this under `ncu --profile-from-start off`); compiles and warm-up stay outside.
  KVARN_NCU_CONFIGS=name,name   DecodeConfig names (default: DEFAULT_CONFIG)
  KVARN_NCU_SHAPE="B ctx Hq Hk D" (default "64 16384 32 8 128")"""
import math
import os

import torch

from kvarn.formats import get_format
from kvarn.kernels.bench import _paged_kvarn
from kvarn.kernels.decode import DEFAULT_CONFIG, DecodeConfig, decode_attention

B, ctx, Hq, Hk, D = (int(x) for x in os.environ.get("KVARN_NCU_SHAPE", "64 16384 32 8 128").split())
names = [n for n in os.environ.get("KVARN_NCU_CONFIGS", DEFAULT_CONFIG.name).split(",") if n]
fmt = get_format("kvarn_k4v2_g128")
dev = torch.device("cuda")
st = _paged_kvarn(fmt, B, ctx, Hk, D, torch.bfloat16, dev)
q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
out = torch.empty_like(q)


def call(cfg):
    decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"], st["tail_slots"],
                     fmt, 1 / math.sqrt(D), out=out, config=cfg, sink_lens=st["sink_lens"])


cfgs = [DecodeConfig.from_name(n) for n in names]
for cfg in cfgs:  # compile + warm
    for _ in range(3):
        call(cfg)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for cfg in cfgs:
    call(cfg)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("profiled:", ", ".join(names), f"at B={B} ctx={ctx} {Hq}/{Hk} D={D}")
