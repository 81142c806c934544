"""Static checks over every Python file, GPU-only code included: CI has no GPU, so a name that
only a GPU test or a CUDA path reaches must still be caught here."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([ROOT / "app.py", *(ROOT / "hierviz").rglob("*.py"), *(ROOT / "tests").glob("*.py")])


def test_pyflakes_rules_pass() -> None:
    """ruff with pyflakes' rules (ruff.toml): undefined names, unused imports, redefinitions."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "app.py", "hierviz", "tests"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_check_fails_on_an_undefined_name_in_gpu_only_code(tmp_path) -> None:
    """Negative control: the same command on a GPU-only test that uses a name it never imported."""
    bad = tmp_path / "test_gpu_plant.py"
    bad.write_text("import torch\n\n\ndef test_x() -> None:\n    assert not triton_w4._COUNTERS[torch.device('cuda')].any()\n")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "ruff.toml"),
                        str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "F821" in r.stdout, r.stdout + r.stderr


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every absolute import in a file, function bodies included: (line, module, names)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("path", [p for p in SOURCES if "hierviz" in p.parts or p.name.startswith("test_gpu")
                                  or p.name == "app.py"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_project_import_resolves(path: Path) -> None:
    """Every `import hierviz...` / `from hierviz... import name` in the file, the deferred ones inside
    GPU-only functions included, names a module and an attribute that exist (imported here, on
    the CPU; modules that need a GPU at import time would fail here too, and none may)."""
    missing = []
    for line, module, names in _imports(path):
        if module.split(".")[0] not in ("hierviz", "tests"):
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{path.name}:{line}: {module} ({e})")
            continue
        for name in names:
            if name != "*" and not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                missing.append(f"{path.name}:{line}: {module}.{name}")
    assert not missing, missing
