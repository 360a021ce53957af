#!/usr/bin/env bash
# Nsight Compute profile of one decode_attention call (scripts/device/ncu_decode.py): every launch's
# duration, occupancy, issue activity and warp-stall reasons, and the records kernel's per-instruction stall samples.
# Firecracker machines only (gVisor has no counters); clocks left alone (--clock-control none).
#   bash scripts/device/ncu.sh
# Writes $OUT/decode.ncu-rep (open in the Nsight Compute GUI), raw.csv (every metric), source_<i>.csv (SASS with
# samples per records-kernel launch) and prints a short table last.
set -u
OUT="${OUT:-$PWD/out-ncu}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 3; }
"$NCU" --version | tail -1
"$NCU" --profile-from-start off --clock-control none --cache-control none --target-processes all \
  --set full --import-source no -f -o "$OUT/decode" python3 scripts/device/ncu_decode.py > "$OUT/ncu_run.log" 2>&1
echo "ncu rc=$?"; tail -n 5 "$OUT/ncu_run.log"
"$NCU" -i "$OUT/decode.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2> "$OUT/raw.err"
"$NCU" -i "$OUT/decode.ncu-rep" --page details --csv > "$OUT/details.csv" 2> "$OUT/details.err"
i=0
for id in $(python3 - "$OUT/raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h = rows[0]
k = h.index("Kernel Name"); i = h.index("ID")
print(" ".join(r[i] for r in rows[2:] if "records_kernel" in r[k]))
PY
); do
  "$NCU" -i "$OUT/decode.ncu-rep" --page source --csv --print-source sass --kernel-id ":::$((id + 1))" \
    > "$OUT/source_$i.csv" 2> "$OUT/source_$i.err" || \
  "$NCU" -i "$OUT/decode.ncu-rep" --page source --csv --print-source sass --launch-skip "$id" --launch-count 1 \
    > "$OUT/source_$i.csv" 2>> "$OUT/source_$i.err"
  i=$((i + 1))
done
python3 - "$OUT" <<'PY'
import csv, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = list(csv.reader(open(out / "raw.csv")))
h, units, data = rows[0], rows[1], rows[2:]
col = {n: j for j, n in enumerate(h)}
def g(r, name, default="-"):
    j = col.get(name)
    return r[j] if j is not None and r[j] != "" else default
want = ["gpu__time_duration.sum", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "launch__registers_per_thread", "launch__occupancy_limit_registers", "launch__grid_size",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"]
print("kernel | " + " | ".join(w.split("__")[1][:28] for w in want))
for r in data:
    print(g(r, "Kernel Name")[:40], "|", " | ".join(g(r, w) for w in want))
stalls = sorted(n for n in h if n.startswith("smsp__average_warp_latency_issue_stalled_")
                or (n.startswith("smsp__average_warps_issue_stalled_") and n.endswith("_per_issue_active.ratio")))
for r in data:
    if "pair" not in g(r, "Kernel Name"):
        continue
    vals = sorted(((float(g(r, n, "0") or 0), n) for n in stalls), reverse=True)[:12]
    print("\nstalls per issued instruction,", g(r, "Kernel Name")[:40], g(r, "gpu__time_duration.sum"), "us")
    for v, n in vals:
        short = n.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "")
        print(f"  {v:8.3f}  {short}")
PY
