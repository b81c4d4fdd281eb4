"""Test fixtures: GPU tests skip cleanly without a GPU; the rest need 8 devices.

The CPU suite runs on the 8 host devices that XLA_FLAGS forces (the root
conftest.py). On a GPU machine JAX would make the GPU its default backend, so
a session that cannot select a GPU test is pinned to the CPU platform before
JAX starts a backend (collecting the tests starts one), and so are the
processes its tests spawn: ``python -m pytest -m "not gpu and not slow"``, or
a run of test files none of which has a GPU test. A session that can select GPU tests
keeps the GPU, and there the CPU tests skip. A JAX_PLATFORMS set by the caller
is left alone.
"""

import importlib
import os
import pathlib

import jax
import pytest
from _pytest.mark.expression import Expression

GPU_MARK = "pytest.mark.gpu"  # how a GPU test file marks its tests


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _marks_exclude_gpu(markexpr: str) -> bool:
    """Whether `-m` deselects a test marked gpu (and nothing else)."""
    return bool(markexpr) and not Expression.compile(markexpr).evaluate(
        lambda name, **kwargs: name == "gpu"
    )


def _files_without_gpu_tests(args: list[str]) -> bool:
    """Whether every argument is a test file (or a test in one) with no GPU test."""
    paths = [pathlib.Path(arg.split("::")[0]) for arg in args]
    return bool(paths) and all(p.is_file() and GPU_MARK not in p.read_text() for p in paths)


def pytest_configure(config):
    if "JAX_PLATFORMS" in os.environ:
        return
    if _marks_exclude_gpu(config.option.markexpr) or _files_without_gpu_tests(config.args):
        os.environ["JAX_PLATFORMS"] = "cpu"  # read by every process the tests start
        jax.config.update("jax_platforms", "cpu")  # this process: JAX read the variable at import


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _enough_devices():
    if jax.device_count() < 8:
        pytest.skip(
            "needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (on a "
            'GPU machine, run the CPU tests apart from the GPU ones: -m "not gpu and not slow")'
        )


@pytest.fixture
def started_in_one_process(monkeypatch):
    """Double buffering starts its exchange across steps only across
    processes (Reduction.starts_between_steps); tests that use this run that
    path between the devices of this one."""
    # The module: jaxcomm.collectives.reduction is also the function's name.
    module = importlib.import_module("jaxcomm.collectives.reduction")
    monkeypatch.setattr(module, "START_IN_ONE_PROCESS", True)
