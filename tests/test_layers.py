"""Layers meet at public names: no module outside ``jaxcomm/collectives/``
imports a private name of ``jaxcomm.collectives``, and none outside
``jaxcomm/transforms/`` one of ``jaxcomm.transforms``. Tests may."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("jaxcomm.collectives", "jaxcomm.transforms")
CHECKED = ("jaxcomm", "bench", "examples")


def _module_of(path: pathlib.Path) -> tuple[str, bool]:
    """(dotted name, whether it is a package's __init__)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imported_names(source: str, module: str, package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `source` imports, relative imports
    resolved against `module` (the importing module's dotted name)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # `from . import x` in a package's __init__ is the package itself.
                parts = module.split(".") + ([""] if package else [])
                parent = parts[: -node.level]
                base = ".".join([*parent, base] if base else parent)
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return names


def private_crossings(source: str, module: str, package: bool = False) -> list[str]:
    """Imports of a private name of a layer from a module outside that layer."""
    found = []
    for line, name in imported_names(source, module, package):
        for layer in LAYERS:
            if module == layer or module.startswith(layer + "."):
                continue
            if not name.startswith(layer + "."):
                continue
            inside = name[len(layer) + 1 :].split(".")
            if any(part.startswith("_") for part in inside):
                found.append(f"{module}:{line} imports {name}")
    return found


def test_checker_finds_private_imports():
    """The checker itself: each way of reaching a private name is caught."""
    bad = [
        "from jaxcomm.collectives import _ffi",
        "from jaxcomm.collectives._axes import placement",
        "import jaxcomm.collectives._xla",
        "from jaxcomm.collectives.allreduce import _masked",
        "from jaxcomm.transforms._buckets import plan_buckets",
        "def f():\n    from jaxcomm.transforms import _state",
    ]
    for source in bad:
        assert private_crossings(source, "jaxcomm.costmodel.simulator"), source
    assert private_crossings("from ..collectives import _checks", "jaxcomm.transforms.chunk_sparse")
    ok = [
        "from jaxcomm.collectives import allreduce, Reduction",
        "import jaxcomm.collectives",
        "from jaxcomm.transforms import plan_buckets",
        "from jaxcomm import _validate",
    ]
    for source in ok:
        assert not private_crossings(source, "jaxcomm.costmodel.simulator"), source
    # Inside its own layer a module may import the layer's private names.
    assert not private_crossings("from jaxcomm.collectives import _ffi", "jaxcomm.collectives.x")
    assert not private_crossings("from . import _state", "jaxcomm.transforms.chunk_sparse")
    assert not private_crossings("from . import _state", "jaxcomm.transforms", package=True)
    assert private_crossings("from .collectives import _ffi", "jaxcomm", package=True)


@pytest.mark.parametrize("top", CHECKED)
def test_no_private_imports_across_layers(top):
    files = sorted((ROOT / top).rglob("*.py"))
    assert files, f"no Python files under {top}/"
    found = []
    for path in files:
        found += private_crossings(path.read_text(), *_module_of(path))
    assert not found, "private names imported across layers:\n" + "\n".join(found)
