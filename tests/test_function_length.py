"""House rule: no function or method in mlaquant/ or calib/ longer than 80 lines (Triton kernels exempt)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mlaquant", "calib")
MAX_LINES = 80
EXEMPT_DECORATORS = {"jit", "autotune"}  # @triton.jit / @triton.autotune bodies are kernels, not host code


def _decorator_name(node: ast.expr) -> str:
    """The last dotted name of a decorator: `triton.jit`, `triton.jit(...)` and `jit` all give 'jit'."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[int, str, int]]:
    """(line, name, length) of each function or method in `source` longer than `limit` lines.

    A function's length runs from its `def` line to its last line (decorators not counted); nested
    functions are measured on their own as well as inside their parent.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any(_decorator_name(d) in EXEMPT_DECORATORS for d in node.decorator_list):
            continue
        length = node.end_lineno - node.lineno + 1
        if length > limit:
            found.append((node.lineno, node.name, length))
    return sorted(found)


def test_long_functions_and_methods_are_found_kernels_exempt():
    body = "".join(f"x{i} = {i}\n" for i in range(MAX_LINES))  # def line + 80 = 81 lines
    fn = lambda name: f"def {name}():\n" + textwrap.indent(body, "    ")
    source = "\n".join(
        [
            "def short():\n    return 1\n",
            fn("long"),
            "@triton.jit\n" + fn("kernel"),
            "@triton.autotune(configs=[], key=[])\n@triton.jit\n" + fn("tuned"),
            "class C:\n" + textwrap.indent(fn("method"), "    "),
        ]
    )
    lines = source.splitlines()
    assert long_functions(source) == [
        (lines.index("def long():") + 1, "long", 81),
        (lines.index("    def method():") + 1, "method", 81),
    ]
    assert long_functions(fn("edge"), limit=81) == []


def test_no_function_is_longer_than_80_lines():
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
        for line, name, length in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"longer than {MAX_LINES} lines (split into named steps):\n" + "\n".join(offenders)
