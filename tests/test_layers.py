"""Layers meet at public names: no module outside a layer's package
(``jaxcomm/collectives/``, ``state/``, ``step/``, ``transforms/``) imports a
private name of it. Tests may. And each layer imports only the layers below
it: collectives, then state, then step, then transforms."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("jaxcomm.collectives", "jaxcomm.state", "jaxcomm.step", "jaxcomm.transforms")
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


def upward_imports(source: str, module: str, package: bool = False) -> list[str]:
    """Imports, by a module of one layer, of a layer above it in LAYERS."""
    own = [i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")]
    if not own:
        return []
    found = []
    for line, name in imported_names(source, module, package):
        for layer in LAYERS[own[0] + 1 :]:
            if name == layer or name.startswith(layer + "."):
                found.append(f"{module}:{line} imports {name}, a layer above it")
    return found


def test_checker_finds_upward_imports():
    """The checker itself: a lower layer reaching up is caught, reaching down is not."""
    assert upward_imports("from jaxcomm.transforms import local_params", "jaxcomm.step.grad")
    assert upward_imports("from jaxcomm import step", "jaxcomm.state.specs")
    assert upward_imports("def f():\n    import jaxcomm.state", "jaxcomm.collectives.wire")
    assert not upward_imports("from jaxcomm.state import state_specs", "jaxcomm.step.grad")
    assert not upward_imports("from jaxcomm.step import grad", "jaxcomm.transforms.diloco")
    assert not upward_imports("from jaxcomm.transforms import diloco", "jaxcomm.costmodel.plan")


def test_layers_import_only_the_layers_below():
    found = []
    for path in sorted((ROOT / "jaxcomm").rglob("*.py")):
        found += upward_imports(path.read_text(), *_module_of(path))
    assert not found, "imports of a layer above:\n" + "\n".join(found)


# Private JAX lives in one module, so that a JAX release that moves a name
# breaks one file: every other module reaches it through that one.
JAX_COMPAT = "jaxcomm._jax_compat"
PRIVATE_JAX = ("jax._src", "jax.interpreters", "jaxlib")


def private_jax_uses(source: str, module: str, package: bool = False) -> list[str]:
    """Imports of private JAX (``jax._src``, ``jax.interpreters``, ``jaxlib``,
    a private name of ``jax.extend``) and reads of ``jax._src`` /
    ``jax.interpreters`` as attributes, anywhere in ``source``."""
    found = []
    for line, name in imported_names(source, module, package):
        private = any(name == p or name.startswith(p + ".") for p in PRIVATE_JAX)
        extend = name.startswith("jax.extend.") and any(
            part.startswith("_") for part in name.split(".")[2:]
        )
        if private or extend:
            found.append(f"{module}:{line} imports {name}")
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "jax"
            and node.attr in ("_src", "interpreters")
        ):
            found.append(f"{module}:{node.lineno} reads jax.{node.attr}")
    return found


def test_checker_finds_private_jax():
    """The checker itself: each way of reaching private JAX is caught."""
    bad = [
        "from jax._src import core",
        "import jax._src.mesh",
        "def f():\n    from jax._src.distributed import global_state",
        "import jaxlib",
        "from jaxlib import _jax",
        "import jaxlib.xla_client as xc",
        "from jax import _src",
        "from jax.interpreters import mlir",
        "import jax.interpreters.pxla",
        "from jax.extend import _private",
        "from jax.extend.backend import _private",
        "import jax\njax._src.core.get_axis_env()",
        "def version():\n    import jaxlib\n    return jaxlib.__version__",
    ]
    for source in bad:
        assert private_jax_uses(source, "jaxcomm.collectives._ffi"), source
    ok = [
        "import jax",
        "from jax import lax, numpy as jnp",
        "from jax.extend import backend",
        "from jax.sharding import get_abstract_mesh",
        "from jaxcomm import _jax_compat",
        "import jaxcomm._jax_compat",
        "jax.lax.psum(x, 'i')",
    ]
    for source in ok:
        assert not private_jax_uses(source, "jaxcomm.collectives._ffi"), source


@pytest.mark.parametrize("top", CHECKED)
def test_private_jax_only_in_compat_module(top):
    files = sorted((ROOT / top).rglob("*.py"))
    assert files, f"no Python files under {top}/"
    found = []
    for path in files:
        module, package = _module_of(path)
        if module != JAX_COMPAT:
            found += private_jax_uses(path.read_text(), module, package)
    assert not found, (
        f"private JAX outside {JAX_COMPAT} (add a function there instead):\n" + "\n".join(found)
    )


def test_compat_module_imports_no_jax_at_import():
    """Its imports are made when a function is called, as they were where
    they came from: importing it must not load JAX's internals."""
    path = ROOT / "jaxcomm" / "_jax_compat.py"
    top_level = ast.parse(path.read_text()).body
    names = [
        alias.name if isinstance(node, ast.Import) else node.module
        for node in top_level
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert names and not [n for n in names if n.split(".")[0] in ("jax", "jaxlib")], names


# Which implementation runs where is decided by the backend classes
# (jaxcomm/collectives/backends/) alone: nothing else asks for the platform or
# compares a backend's name. The extension registry says which platforms have
# handlers; the agreement check records the platform and never branches on it.
PLATFORM_DECIDERS = (
    "jaxcomm.collectives.backends",
    "jaxcomm.collectives._extension",
    "jaxcomm.distributed.agreement",
)
PLATFORM_NAMES = {"xla", "ffi", "cpu", "gpu", "cuda", "rocm", "tpu"}


def platform_branches(source: str, module: str) -> list[str]:
    """Comparisons against a backend or platform name, and asks of the
    platform (``jax.default_backend()``, ``jax.devices("gpu")``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [
                s.value for s in sides if isinstance(s, ast.Constant) and s.value in PLATFORM_NAMES
            ]
            if names:
                found.append(f"{module}:{node.lineno} compares with {names[0]!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            asks = f.attr == "default_backend" or (f.attr == "devices" and node.args)
            if asks and isinstance(f.value, ast.Name) and f.value.id == "jax":
                found.append(f"{module}:{node.lineno} asks jax.{f.attr}()")
    return found


def test_checker_finds_platform_branches():
    bad = [
        'if jax.default_backend() == "cpu":\n    pass',
        "on_gpu = jax.default_backend()",
        'use_ffi = backend == "ffi"',
        'if bound.backend.name != "xla":\n    pass',
        'gpus = jax.devices("gpu")',
        'x = 1 if "gpu" in platforms else 2',
    ]
    for source in bad:
        assert platform_branches(source, "m"), source
    ok = [
        "bound.backend.allreduce(bound, flat)",
        "if bound.backend.sends_only_selected:\n    pass",
        'if algorithm == "hierarchical":\n    pass',
        "jax.devices()",
    ]
    for source in ok:
        assert not platform_branches(source, "m"), source


def test_only_backends_decide_the_platform():
    found = []
    for path in sorted((ROOT / "jaxcomm").rglob("*.py")):
        module, _ = _module_of(path)
        if any(module == d or module.startswith(d + ".") for d in PLATFORM_DECIDERS):
            continue
        found += platform_branches(path.read_text(), module)
    assert not found, (
        "platform or backend branches outside jaxcomm/collectives/backends/ (add an "
        "operation or an attribute to the Backend classes instead):\n" + "\n".join(found)
    )


def test_diloco_names_no_outer_step():
    """diloco takes any OuterStep (transforms/outer_step.py): it imports no
    implementation, so the outer steps import diloco's protocol, not the
    reverse."""
    path = ROOT / "jaxcomm" / "transforms" / "diloco.py"
    names = [
        name for _, name in imported_names(path.read_text(), "jaxcomm.transforms.diloco", False)
    ]
    assert "jaxcomm.transforms.outer_step.OuterStep" in names
    assert not [n for n in names if n.startswith("jaxcomm.transforms.sparseloco")]
