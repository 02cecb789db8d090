"""The package's layering, read from the source with `ast` (nothing is imported).

`calib/` (package `mlaquant.calib`) may import `mlaquant`, never the reverse; `mlaquant.bench` is a floor above
calib (it may import `mlaquant.calib` and the rest) that nothing below imports; no module imports another
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
# floors above the rest of mlaquant, lowest first: each may import the floors below it, and nothing below imports it
UPPER = ("mlaquant.calib", "mlaquant.bench")


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _floor(name: str) -> int:
    """0 for the rest of mlaquant, i + 1 for a module of UPPER[i]."""
    return next((i + 1 for i, upper in enumerate(UPPER) if _in(name, upper)), 0)


def _imports_from_below(upper: str) -> list[str]:
    """Each import of `upper` (a package of UPPER) by a module on a lower floor, as 'file:line imports x'."""
    bad = []
    for name in MODULES:
        if _floor(name) >= _floor(upper):
            continue
        for target, symbol, line in _imports(name):
            module = _internal(target)
            if module and _in(module, upper):
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
                           + (f".{symbol}" if symbol else ""))
    return bad


def test_every_source_folder_is_walked():
    assert "mlaquant.cli" in MODULES and "mlaquant.calib.calibrate" in MODULES
    assert "mlaquant.kernels.mla_decode" in MODULES
    for name in ("mlaquant.quant.codecs", "mlaquant.attention.ops", "mlaquant.modeling.model",
                 "mlaquant.runtime.session", "mlaquant.evaluation.eval", "mlaquant.integrations.export",
                 "mlaquant.bench.gpu", "mlaquant.bench.kernels", "mlaquant.bundled.train"):
        assert name in MODULES, name
    assert len(MODULES) > 20


def test_floors_are_found():
    assert _floor("mlaquant.runtime.session") == 0 and _floor("mlaquant.kernels.mla_decode") == 0
    assert _floor("mlaquant.calib.calibrate") == 1 and _floor("mlaquant.bench.gpu") == 2
    assert _floor("mlaquant.bench") == 2 and _floor("mlaquant.benchmark") == 0


def test_lower_layers_never_import_calib():
    bad = _imports_from_below("mlaquant.calib")
    assert not bad, "modules below calib import it:\n" + "\n".join(bad)


def test_nothing_below_imports_bench():
    bad = _imports_from_below("mlaquant.bench")
    assert not bad, "modules below mlaquant.bench (calib included) import it:\n" + "\n".join(bad)


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
