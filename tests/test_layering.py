"""The package's layering, read from the source with `ast` (nothing is imported).

`calib/` (package `mlaquant.calib`) may import `mlaquant`, never the reverse; no module imports another
module's private (`_x`) names; the module import graph has no cycles. Every `import` / `from ... import`
counts, including those inside functions. `mlaquant.cli` names subcommand modules as strings for
`importlib`, which is not an import statement and is the one allowed upward reference.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the graph-building helpers live in scripts/import_graph.py (which prints the graph); loaded from its path
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

MODULES = import_graph.MODULES
_imports = import_graph.imports
_internal = import_graph.internal
_graph = import_graph.graph
_find_cycle = import_graph.find_cycle
UPPER = ("mlaquant.calib",)  # packages that may import the rest of mlaquant, and that nothing below imports


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


def test_cycle_finder_reports_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    assert import_graph.cycles({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [["a", "b"]]


def test_import_graph_has_no_cycles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
