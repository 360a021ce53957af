"""One decode_attention call inside a cudaProfilerStart/Stop range, for ncu (scripts/device/ncu.sh runs this under
`ncu --profile-from-start off`); compiles and warm-up stay outside.
  KVARN_NCU_SHAPE="B ctx Hq Hk D" (default "64 16384 32 8 128")"""
import math
import os

import torch

from kvarn.bench.microbench import paged_kvarn
from kvarn.formats import get_format
from kvarn.kernels.decode import decode_attention

B, ctx, Hq, Hk, D = (int(x) for x in os.environ.get("KVARN_NCU_SHAPE", "64 16384 32 8 128").split())
fmt = get_format("kvarn_k4v2_g128")
dev = torch.device("cuda")
st = paged_kvarn(fmt, B, ctx, Hk, D, torch.bfloat16, dev)
q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
out = torch.empty_like(q)


def call():
    decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"], st["tail_slots"],
                     fmt, 1 / math.sqrt(D), out=out, sink_lens=st["sink_lens"])


for _ in range(3):  # compile + warm
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print(f"profiled decode_attention at B={B} ctx={ctx} {Hq}/{Hk} D={D}")
