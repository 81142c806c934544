"""Bulk where a reader looks first: no module of hierviz/ over 800 lines, no function over 80, no
kernel source inside a Python string, and no hand-written list of method names outside the method
registry (a new method is one module and one registry entry)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "hierviz").rglob("*.py"))
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 80


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_module_and_function_size(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count("\n") <= MAX_MODULE_LINES, f"{_rel(path)} has {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{_rel(path)}:{node.lineno} {node.name} is {n} lines long"


def method_name_lists(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines of tuple, list or set displays holding two or more method names."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
            if len(found) >= 2:
                out.append(node.lineno)
    return out


def test_no_method_name_list_outside_the_registry() -> None:
    from hierviz import methods
    names = set(methods.METHODS)
    offenders = {}
    for path in SOURCES:
        if path.name == "methods.py":
            continue
        lines = method_name_lists(ast.parse(path.read_text(encoding="utf-8")), names)
        if lines:
            offenders[_rel(path)] = lines
    assert not offenders, f"method names listed by hand (read hierviz.methods instead): {offenders}"


def test_the_method_list_check_finds_one() -> None:
    """Negative control: the check sees a tuple of method names."""
    tree = ast.parse('ORDER = ("hierspec", "eagle2", "ar")\nOK = ("hierspec", "other")\n')
    assert method_name_lists(tree, {"hierspec", "eagle2", "ar"}) == [1]


def test_no_kernel_source_in_a_python_string() -> None:
    """CUDA C lives in .cu files a reader can open (NVRTC reads them at run time)."""
    for path in SOURCES:
        if re.search(r"__global__\s+void", path.read_text(encoding="utf-8")):
            raise AssertionError(f"{_rel(path)} holds CUDA C: move it to a .cu file beside it")
