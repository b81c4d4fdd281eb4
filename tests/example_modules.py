"""Importing an example's scripts in a test without clashing with another example's.

Each example is a directory of flat scripts (``main.py``, ``train.py``, ...)
that import each other by bare name, as ``python examples/x/main.py`` runs
them. Two examples both have a ``main`` and a ``train``: once one is in
``sys.modules`` the other's ``import train`` would get it. ``load`` imports
an example's modules with its directory first on the path and then takes its
bare names out of ``sys.modules`` again; the returned modules keep their own
references.
"""

from __future__ import annotations

import importlib
import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(example: str, *modules: str) -> list:
    """The modules `modules` of examples/`example`, imported afresh."""
    directory = EXAMPLES / example
    names = {p.stem for p in directory.glob("*.py")}
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(directory))
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        sys.path.remove(str(directory))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
