"""What reduce_scatter and all_gather share: the input checked and flattened,
the options bound."""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomm.collectives import _checks
from jaxcomm.collectives.reduction import BoundReduction, reduction


def prepare(x, axis_name, *, op: str, wire_dtype, backend) -> tuple:
    """(flat x, its BoundReduction): the input's dtype checked, then the
    options, as :func:`reduction` does."""
    x = jnp.asarray(x)
    _checks.check_input_dtype("x", x.dtype)
    bound: BoundReduction = reduction(
        axis_name, op=op, wire_dtype=wire_dtype, backend=backend
    ).bind()
    if bound.reduction.wire.scaled:
        raise TypeError(
            f"wire_dtype={bound.reduction.wire_dtype.name}: reduce_scatter and all_gather take "
            "float16 and bfloat16 wires; FP8 wires are for allreduce, as are int8 and int4"
        )
    return x.reshape(-1), bound
