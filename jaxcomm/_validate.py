"""Checks of plain-number options (counts, sizes, fractions, times) and of
input trees, shared by every layer so that each kind of mistake reads the
same everywhere.

A bool is never a number here: ``True`` would otherwise pass for 1.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def is_integer(value) -> bool:
    """A Python or NumPy integer."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A Python or NumPy real number. NaN fails every range check."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_flag(name: str, value) -> bool:
    """True or False (a NumPy bool too); 0 and 1 are not flags here."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be True or False")
    return bool(value)


def check_int(name: str, value, *, minimum: int) -> int:
    """An integer >= `minimum` (a rank count, a number of elements)."""
    if not is_integer(value):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def check_ranks(name: str, value) -> int:
    """A rank count: an int >= 1."""
    return check_int(name, value, minimum=1)


def check_positive_integer(name: str, value) -> int:
    """An integer > 0 (a chunk size, a bound on chunks)."""
    if not is_integer(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


def check_count(name: str, value) -> int:
    """An integer >= 0 (a number of steps)."""
    if not is_integer(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")
    return int(value)


def check_fraction(name: str, value, *, zero: bool) -> float:
    """A real number in (0, 1], or [0, 1] when `zero` is allowed."""
    if not is_real(value) or not (0 <= value if zero else 0 < value) or not value <= 1:
        raise ValueError(f"{name}={value!r} must be in {'[' if zero else '('}0, 1]")
    return float(value)


def check_nonnegative(name: str, value) -> float:
    """A finite number >= 0 (a size, a latency or a time per byte)."""
    if not is_real(value):
        raise TypeError(f"{name}={value!r} must be a number")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value} must be finite and >= 0")
    return float(value)


def check_positive(name: str, value) -> float:
    """A number > 0 (a timeout)."""
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return float(value)


def check_positive_real(name: str, value) -> float:
    """A real number > 0 (inf allowed: a rate, a ratio)."""
    if not is_real(value):
        raise TypeError(f"{name}={value!r} must be a number")
    return check_positive(name, value)


def check_bucket_bytes(bucket_bytes) -> float:
    """The fusion threshold θ: 0, a positive number, or math.inf."""
    if not is_real(bucket_bytes):
        raise TypeError(f"bucket_bytes={bucket_bytes!r} must be a number of bytes or math.inf")
    if math.isnan(bucket_bytes) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be >= 0 (0: one collective per leaf)")
    return float(bucket_bytes)


def check_optimizer(name: str, tx) -> None:
    """Refuses ``tx`` unless it has optax's ``init`` and ``update``."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{name}={tx!r} must be an optax.GradientTransformation, e.g. optax.sgd(0.1)"
        )


def check_same_tree(updates, reference, what: str, argument: str = "gradient") -> None:
    """Raises ValueError naming the first path where the gradient tree and
    `reference` (a tree the state was built with) differ in leaves or shapes."""
    got = {
        jax.tree_util.keystr(p): jnp.shape(x)
        for p, x in jax.tree_util.tree_leaves_with_path(updates)
    }
    want = {
        jax.tree_util.keystr(p): jnp.shape(x)
        for p, x in jax.tree_util.tree_leaves_with_path(reference)
    }
    if got == want:
        return
    hint = "the gradient's tree must be that of the params the optimizer state was built for"
    for path, shape in want.items():
        if path not in got:
            raise ValueError(f"{argument}{path} is missing: {hint}")
        if got[path] != shape:
            raise ValueError(
                f"{argument}{path} has shape {got[path]} but the {what} holds {shape} there: {hint}"
            )
    extra = next(p for p in got if p not in want)
    raise ValueError(f"{argument}{extra} is not in the {what}: {hint}")
