"""The wheel must carry every package and the bundled data (the GPU machine installs a plain, non-editable copy)."""
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {str(p.parent.relative_to(ROOT)).replace("/", ".") for p in ROOT.glob("kvarn*/**/__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


@pytest.mark.slow
def test_wheel_carries_suites_and_data(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True)
    names = zipfile.ZipFile(next(tmp_path.glob("kvarn-*.whl"))).namelist()
    for f in ("kvarn/suites/models/qwen3-8b.json", "kvarn/suites/nightly.yaml", "kvarn/data/moby_dick.txt",
              "kvarn_cli/commands/bench.py"):
        assert f in names
