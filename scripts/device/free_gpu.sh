#!/usr/bin/env bash
# Ends the GPU processes a part left behind (a leftover engine keeps its memory). In a lane of run.sh (KVARN_GPU=i)
# only those on GPU i: the other lane's engines run on. Under KVARN_SHARED_GPU=1 (parts side by side, together.sh)
# nothing: the GPU's processes are the other parts' engines.
[ "${KVARN_SHARED_GPU:-0}" = 1 ] && exit 0
for pid in $(nvidia-smi ${KVARN_GPU:+-i "$KVARN_GPU"} --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
  [ "$pid" != "$$" ] && kill -9 "$pid" 2>/dev/null
done
exit 0
