"""What reduce_scatter and all_gather share: the input checked, flattened and placed."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.collectives import _checks
from jaxcomm.collectives._axes import AxisPlacement
from jaxcomm.collectives.reduction import reduction


class Prepared(NamedTuple):
    """A collective call after validation, flattened and placed."""

    flat: jax.Array  # the input as 1-D
    dtype: np.dtype  # input (and output) dtype
    wire: np.dtype  # what travels
    backend: str  # "xla" or "ffi"
    place: AxisPlacement
    prescale: float
    postscale: float


def prepare(x, axis_name, *, op: str, wire_dtype, backend: str) -> Prepared:
    """Checks the input's dtype, then the options, as :func:`reduction` does."""
    x = jnp.asarray(x)
    dtype = _checks.check_input_dtype("x", x.dtype)
    bound = reduction(axis_name, op=op, wire_dtype=wire_dtype, backend=backend).bind()
    if bound.reduction.fp8:
        raise TypeError(
            f"wire_dtype={bound.reduction.wire_dtype.name}: reduce_scatter and all_gather take "
            "float16 and bfloat16 wires; FP8 wires are for allreduce"
        )
    wire, prescale, postscale = bound.scales(dtype)
    return Prepared(x.reshape(-1), dtype, wire, bound.backend, bound.place, prescale, postscale)
