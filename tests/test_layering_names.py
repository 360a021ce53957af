"""Package structure users and maintainers rely on: no import cycles nor private names imported across modules
(scripts/check_imports.py over kvarn and kvarn_cli), and a small, documented environment surface: every KVARN_*
name the package spells is a setting of kvarn.settings (what `kvarn env` lists), at most 8 of them, and only
kvarn/settings.py reads them from the environment."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from kvarn import settings

ROOT = Path(__file__).resolve().parents[1]
MAX_SETTINGS = 8
NAME = re.compile(r"KVARN_[A-Z0-9_]+")


def test_check_imports_passes_on_kvarn_and_kvarn_cli():
    r = subprocess.run([sys.executable, "scripts/check_imports.py", "kvarn", "kvarn_cli"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 cycles, 0 private imports" in r.stdout, r.stdout


def _sources():
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted((ROOT / "kvarn").rglob("*.py"))]


def test_every_kvarn_name_in_the_package_is_a_declared_setting():
    spelled = {n.value: p.relative_to(ROOT) for p, tree in _sources() for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.fullmatch(n.value)}
    undeclared = {k: str(p) for k, p in spelled.items() if k not in settings.BY_NAME}
    assert not undeclared, f"KVARN_* names outside kvarn.settings.SETTINGS: {undeclared}"
    assert len(settings.SETTINGS) <= MAX_SETTINGS, [s.name for s in settings.SETTINGS]


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _kvarn_key(node) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("KVARN_")
    if isinstance(node, ast.JoinedStr) and node.values:  # f"KVARN_{x}"
        first = node.values[0]
        return isinstance(first, ast.Constant) and str(first.value).startswith("KVARN_")
    return False


def _environment_reads(tree):
    """Line numbers where a KVARN_* name is read from the environment (os.environ.get / [] / in, os.getenv)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and _kvarn_key(n.args[0]):
            f = n.func
            if isinstance(f, ast.Attribute) and (f.attr == "getenv"
                                                 or (f.attr in ("get", "pop") and _is_environ(f.value))):
                yield n.lineno
            elif isinstance(f, ast.Name) and f.id == "getenv":
                yield n.lineno
        elif isinstance(n, ast.Subscript) and _is_environ(n.value) and _kvarn_key(n.slice):
            yield n.lineno
        elif (isinstance(n, ast.Compare) and _kvarn_key(n.left)
              and any(isinstance(o, (ast.In, ast.NotIn)) for o in n.ops) and any(map(_is_environ, n.comparators))):
            yield n.lineno


def test_only_kvarn_settings_reads_kvarn_names_from_the_environment():
    found = [f"{p.relative_to(ROOT)}:{line}" for p, tree in _sources() if p != ROOT / "kvarn" / "settings.py"
             for line in _environment_reads(tree)]
    assert not found, f"read through kvarn.settings.get instead: {found}"
    # the scan itself sees each form of read
    probe = ast.parse('os.environ.get("KVARN_X")\nos.getenv("KVARN_X")\nos.environ["KVARN_X"]\n'
                      '"KVARN_X" in os.environ\nos.environ.get(f"KVARN_{n}")\nos.environ.get("HF_HOME")')
    assert list(_environment_reads(probe)) == [1, 2, 3, 4, 5]
