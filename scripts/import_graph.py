"""The package's import graph, read from the source with `ast` (nothing is imported).

    python scripts/import_graph.py

Prints the number of modules, packages, internal import edges (module → module) and import cycles
(groups of modules that import each other, directly or not), then, for each package, its imports of the
other packages (how many module edges go to each) and the cycles of that package graph. Every `import` /
`from ... import` counts, including those inside functions; strings that name modules (`mlaquant.cli`'s
subcommand table) do not.

tests/test_layering.py loads this file (importlib, from its path) for the same graph: `MODULES`,
`imports`, `internal`, `graph` and `find_cycle` are what its layering checks read.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> package name, as pyproject.toml's [tool.setuptools.package-dir] maps them
PACKAGES = {"mlaquant": "mlaquant", "calib": "mlaquant.calib", "kernels": "mlaquant.kernels",
            "configs": "mlaquant.configs"}  # fmt: skip


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file, for every .py file of the package folders under `root`."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = find_modules()


def is_package(name: str) -> bool:
    """Whether module `name` is a package (its source is an `__init__.py`)."""
    return MODULES[name].name == "__init__.py"


def package_of(name: str) -> str:
    """The package module `name` belongs to: itself for a package's `__init__`, else its parent."""
    return name if is_package(name) else name.rpartition(".")[0]


def imports(name: str) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for each import in module `name`."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"), filename=str(MODULES[name]))
    here = package_of(name)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:  # `from pkg import module` imports the module
                    out.append((submodule, None, node.lineno))
                else:
                    out.append((base, alias.name, node.lineno))
    return out


def internal(target: str) -> str | None:
    """The project module an imported dotted name refers to (its longest known prefix), else None."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return None


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's __init__ counts as its own module)."""
    edges_of = {}
    for name in MODULES:
        edges = set()
        for target, _symbol, _line in imports(name):
            module = internal(target)
            if module is not None and module != name:
                edges.add(module)
        edges_of[name] = edges
    return edges_of


def find_cycle(edges_of: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative depth-first search)."""
    state = {}  # 1: on the current path, 2: done
    for start in sorted(edges_of):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(edges_of[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges_of[nxt])))
    return None


def cycles(edges_of: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected groups of more than one node (each a cycle or several), sorted."""
    reach = {n: _reachable(edges_of, n) for n in edges_of}
    groups = {frozenset(m for m in reach[n] if n in reach[m]) | {n} for n in edges_of}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def _reachable(edges_of: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(edges_of[start])
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += edges_of.get(n, ())
    return seen


def package_imports(edges_of: dict[str, set[str]]) -> dict[str, Counter]:
    """Package -> Counter of the other packages its modules import (module edges per package)."""
    out = {package_of(name): Counter() for name in edges_of}
    for name, edges in edges_of.items():
        for module in edges:
            if package_of(module) != package_of(name):
                out[package_of(name)][package_of(module)] += 1
    return dict(sorted(out.items()))


def report() -> str:
    edges_of = graph()
    packages = package_imports(edges_of)
    groups = cycles(edges_of)
    lines = [
        f"modules: {len(MODULES)}",
        f"packages: {len(packages)}",
        f"internal import edges: {sum(len(e) for e in edges_of.values())}",
        f"cycles: {len(groups)}",
        *(f"  cycle group: {' '.join(g)}" for g in groups),
        "",
        "package imports of other packages (module edges):",
    ]
    for package, counts in packages.items():
        modules = sum(1 for name in MODULES if package_of(name) == package)
        targets = ", ".join(f"{p} ({n})" for p, n in sorted(counts.items())) or "-"
        lines.append(f"  {package} [{modules} modules] -> {targets}")
    package_groups = cycles({p: set(counts) for p, counts in packages.items()})
    lines.append(f"package cycles: {len(package_groups)}")
    lines += [f"  package cycle group: {' '.join(g)}" for g in package_groups]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
