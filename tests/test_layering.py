"""The package's layering, read from the source with `ast` (nothing is imported).

`calib/` (package `mlaquant.calib`) may import `mlaquant`, never the reverse; no module imports another
module's private (`_x`) names; the module import graph has no cycles. Every `import` / `from ... import`
counts, including those inside functions. `mlaquant.cli` names subcommand modules as strings for
`importlib`, which is not an import statement and is the one allowed upward reference.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> package name, as pyproject.toml's [tool.setuptools.package-dir] maps them
PACKAGES = {"mlaquant": "mlaquant", "calib": "mlaquant.calib", "kernels": "mlaquant.kernels",
            "configs": "mlaquant.configs"}
UPPER = ("mlaquant.calib",)  # packages that may import the rest of mlaquant, and that nothing below imports


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every .py file of the package folders."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for each import in module `name`."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    here = name if _is_package(name) else name.rpartition(".")[0]
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


def _internal(target: str) -> str | None:
    """The project module an imported dotted name refers to (its longest known prefix), else None."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return None


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_every_source_folder_is_walked():
    assert "mlaquant.cli" in MODULES and "mlaquant.calib.calibrate" in MODULES
    assert "mlaquant.kernels.mla_decode" in MODULES
    assert len(MODULES) > 20


def test_lower_layers_never_import_calib():
    bad = []
    for name in MODULES:
        if any(_in(name, upper) for upper in UPPER):
            continue
        for target, symbol, line in _imports(name):
            module = _internal(target)
            if module and any(_in(module, upper) for upper in UPPER):
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
                           + (f".{symbol}" if symbol else ""))
    assert not bad, "modules below calib import it:\n" + "\n".join(bad)


def test_no_import_of_another_modules_private_names():
    bad = []
    for name in MODULES:
        for target, symbol, line in _imports(name):
            module = _internal(target)
            if module is None or module == name:
                continue
            private = [p for p in target[len(module):].split(".") if p.startswith("_")]
            if symbol is not None and symbol.startswith("_") and not symbol.startswith("__"):
                private.append(symbol)
            if private:
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {target} {private}")
    assert not bad, "imports of private names:\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's __init__ counts as its own module)."""
    graph = {}
    for name in MODULES:
        edges = set()
        for target, _symbol, _line in _imports(name):
            module = _internal(target)
            if module is not None and module != name:
                edges.add(module)
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_cycle_finder_reports_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_has_no_cycles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
