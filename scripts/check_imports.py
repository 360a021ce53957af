"""Import structure of a package, from its source (no import is run): module-level import cycles, and private
names (`_x`) imported from another module. Exit 1 when there is either.

    python scripts/check_imports.py kvarn/kernels kvarn/vllm_plugin kvarn/method kvarn/bench

Each argument is a folder whose modules are checked; imports of any kvarn module count as edges, those inside
functions too (a lazy import defers the dependency, it does not remove it). --module-level: only the imports that
run at import time.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def _imports(tree, module_level: bool):
    if not module_level:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    stack = list(tree.body)  # module level (also inside top-level try / if)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.Try, ast.If)):
            stack.extend(n.body + n.orelse + [h for x in getattr(n, "handlers", []) for h in x.body])
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            yield n


def edges(path: Path, module_level: bool) -> tuple[set[str], list[str]]:
    """(kvarn modules imported, private names imported from other modules)."""
    mod, is_pkg = module_name(path), path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    out, private = set(), []
    for n in _imports(tree, module_level):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.startswith("kvarn"))
        else:
            target = resolve(mod, is_pkg, n.level, n.module)
            if not target.startswith("kvarn"):
                continue
            for a in n.names:
                sub = f"{target}.{a.name}"
                out.add(sub if (ROOT / Path(*sub.split("."))).with_suffix(".py").exists()
                        or (ROOT / Path(*sub.split(".")) / "__init__.py").exists() else target)
                if a.name.startswith("_") and not a.name.startswith("__"):
                    private.append(f"{mod}: {a.name} from {target}")
    return {m for m in out if m != mod}, private


def main(args: list[str]) -> int:
    module_level = "--module-level" in args
    folders = [a for a in args if not a.startswith("--")] or ["kvarn"]
    files = [p for f in folders for p in sorted((ROOT / f).rglob("*.py"))]
    graph, private = {}, []
    for p in files:
        graph[module_name(p)], priv = edges(p, module_level)
        private += priv
    cycles, seen = [], set()

    def visit(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cyc = path[path.index(nxt):] + [nxt]
                key = frozenset(cyc)
                if key not in seen:
                    seen.add(key)
                    cycles.append(cyc)
            elif nxt in graph and len(path) < 30:
                visit(nxt, path + [nxt])

    for m in sorted(graph):
        visit(m, [m])
    for c in cycles:
        print("cycle: " + " -> ".join(c))
    for p in private:
        print("private import: " + p)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(cycles)} cycles, "
          f"{len(private)} private imports across modules")
    return 1 if cycles or private else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
