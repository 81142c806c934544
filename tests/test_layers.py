"""hierviz's import graph points one way: no import cycle between its modules, and no import
against the layer order that docs/architecture.md ("Layers") shows and LAYERS below holds.

Every import counts, at module level or inside a function (a deferred import runs too, only later);
`from hierviz.x import y` where y is a module is an import of that module. Importing a package's
submodule runs the package's __init__ first, which is not an import by the submodule."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hierviz"

# Bottom to top. A module may import modules of its own layer and of the layers below it, never
# of a layer above. A layer is named by module or package prefixes.
LAYERS: list[tuple[str, ...]] = [
    ("hierviz.config",),
    ("hierviz.methods",),
    ("hierviz.settings",),
    ("hierviz.trace",),
    ("hierviz.quant",),
    ("hierviz.machine",),
    ("hierviz.models",),
    ("hierviz.decoding",),
    ("hierviz.tokenizer", "hierviz.memory", "hierviz.stack"),
    ("hierviz.engine",),
    ("hierviz.retime",),
    ("hierviz.viz",),
    ("hierviz.measure",),
    ("hierviz.train",),
    ("hierviz.app",),
    ("hierviz.cli", "hierviz.__main__"),
]
# (importing package, imported package) -> the one module of the second the first may import
ENTRIES = {("hierviz.app", "hierviz.measure"): "hierviz.measure.api"}


# ---- the graph ----------------------------------------------------------------------------------

def module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse_sources(top: Path, package: str = PACKAGE) -> dict[str, tuple[ast.Module, bool]]:
    """Every module under top/package by dotted name: (its syntax tree, is it a package __init__)."""
    return {module_name(p, top): (ast.parse(p.read_text(encoding="utf-8"), str(p)), p.name == "__init__.py")
            for p in sorted((top / package).rglob("*.py"))}


def _known(name: str, modules: set[str]) -> Optional[str]:
    """The module `name` is, or the nearest package holding it; None outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, tree: ast.Module, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules `module` imports, anywhere in its code."""
    here = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {_known(a.name, modules) for a in node.names} - {None}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:       # relative: from the importing module's package, up level - 1
                anchor = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _known(base, modules)
                if target:
                    out.add(target)
    return out - {module}


def import_graph(sources: dict[str, tuple[ast.Module, bool]]) -> dict[str, set[str]]:
    modules = set(sources)
    return {m: imports_of(m, tree, pkg, modules) for m, (tree, pkg) in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One import cycle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> Optional[list[str]]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> Optional[int]:
    return next((i for i, prefixes in enumerate(layers) if any(_under(module, p) for p in prefixes)), None)


def against_layers(graph: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS,
                   entries: Optional[dict[tuple[str, str], str]] = None) -> list[str]:
    """Every import of a higher layer by a lower one, and every import past a package's one entry."""
    entries = ENTRIES if entries is None else entries
    bad = []
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            lm, lt = layer_of(m, layers), layer_of(t, layers)
            if lm is not None and lt is not None and lt > lm:
                bad.append(f"{m} -> {t} (layer {lt} above {lm})")
            for (importer, imported), entry in entries.items():
                if _under(m, importer) and _under(t, imported) and t != entry:
                    bad.append(f"{m} -> {t} ({importer} reaches {imported} only through {entry})")
    return bad


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(parse_sources(ROOT))


# ---- the project --------------------------------------------------------------------------------

def test_the_parse_sees_the_imports(graph) -> None:
    """Positive controls on the real code: a module-level import, one inside a function, and a
    `from package import module`."""
    assert "hierviz.settings" in graph["hierviz.trace"]
    assert "hierviz.measure.api" in graph["hierviz.app.profile_tab"]       # inside measure_profile
    assert "hierviz.methods" in graph["hierviz.settings"]                  # from hierviz import methods


def test_every_module_has_a_layer(graph) -> None:
    """A new module (or package) is placed in LAYERS, and docs/architecture.md with it."""
    assert [m for m in graph if m != PACKAGE and layer_of(m) is None] == []
    assert not graph[PACKAGE], "hierviz/__init__.py imports nothing of the project"


def test_no_import_cycle(graph) -> None:
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_against_the_layers(graph) -> None:
    assert against_layers(graph) == []


def test_the_documented_layers_are_these() -> None:
    """docs/architecture.md draws the layers, top to bottom, in the block under "## Layers"."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"## Layers\n.*?```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no layer diagram under ## Layers"
    drawn = []
    for line in block.group(1).splitlines():
        names = re.split(r"\s{2,}", line.strip())[0]
        if names:
            drawn.append(tuple(PACKAGE + "." + n.strip().removesuffix("/").removesuffix(".py")
                               for n in names.split(",")))
    assert drawn == LAYERS[::-1]


# ---- negative controls --------------------------------------------------------------------------

def _sources(tmp_path: Path, files: dict[str, str]) -> dict[str, tuple[ast.Module, bool]]:
    for name, code in files.items():
        path = tmp_path / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    return parse_sources(tmp_path, "p")


def test_a_cycle_is_caught(tmp_path) -> None:
    """Through a function-level import and a `from package import module`, and a relative one."""
    graph = import_graph(_sources(tmp_path, {
        "p.__init__": "", "p.a": "def f():\n    from p import b\n", "p.b": "from .c import x\n",
        "p.c": "import p.a\nx = 1\n"}))
    assert graph == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]


def test_a_package_init_run_first_is_not_a_cycle(tmp_path) -> None:
    """p/__init__ imports p.a, which imports p.b: importing p.b runs p/__init__ first, which is
    not p.b importing anything; an explicit import of the package is."""
    files = {"p.__init__": "from p import a\nVERSION = 1\n", "p.a": "import p.b\n", "p.b": "X = 1\n"}
    assert find_cycle(import_graph(_sources(tmp_path, files))) is None
    files["p.b"] = "from p import VERSION\n"
    assert find_cycle(import_graph(_sources(tmp_path, files))) == ["p", "p.a", "p.b", "p"]


def test_an_upward_import_is_caught() -> None:
    graph = {"hierviz.trace": {"hierviz.settings", "hierviz.viz.style"}, "hierviz.viz.style": set(),
             "hierviz.app.x": {"hierviz.measure.api", "hierviz.measure.whatif"}}
    assert against_layers(graph) == [
        "hierviz.app.x -> hierviz.measure.whatif (hierviz.app reaches hierviz.measure only through hierviz.measure.api)",
        f"hierviz.trace -> hierviz.viz.style (layer {layer_of('hierviz.viz')} above {layer_of('hierviz.trace')})"]
    assert against_layers({"hierviz.measure.x": {"hierviz.app.y"}}) != []
    assert against_layers({"hierviz.app.y": {"hierviz.measure.api", "hierviz.trace"}}) == []
