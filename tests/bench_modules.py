"""Importing a benchmark script (``bench/<name>.py``) in a test.

The scripts are not a package: they import their siblings (``_common``,
``network_worker``) by bare name, as ``python bench/x.py`` runs them.
``load`` imports one from its file with ``bench/`` on the path while it loads.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    """bench/`name`.py, imported afresh as a module of its own."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))
