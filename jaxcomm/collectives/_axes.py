"""Where a device sits on the reduced mesh axes: group size, rank, and group.

A collective over axes A runs one independent ring per combination of the
other bound axes (its *group*); the FFI backend needs both numbers to find
its peers. They come from `lax.axis_index`, so the same code works under
`shard_map` (any mesh) and `pmap`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm import _jax_compat


class AxisPlacement(NamedTuple):
    axes: tuple  # the reduced axes, outermost first
    shape: tuple  # devices along each of them
    size: int  # devices on them all (N)
    rank: jax.Array  # int32, this device's linear index over `axes`
    group: jax.Array  # int32, linear index over the other bound axes
    others: tuple = ()  # the other bound axes (a sharded model's "fsdp"), in binding order


def normalize(axis_name) -> tuple:
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError("axis_name must name at least one axis")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis_name={axis_name!r} repeats an axis")
    return axes


def bound_axes() -> dict:
    """{name: size} of the mesh / pmap axes bound at this point of the trace."""
    return _jax_compat.bound_axis_sizes()


def check_bound(axis_name, *, mesh: bool = False) -> tuple:
    """The axes of `axis_name`, or the one ValueError every jaxcomm entry point
    gives for a name that is not bound here: it names the argument, the bad
    name(s) and the axes that are bound (shard_map's mesh, pmap's axis_name).

    With `mesh`, outside shard_map / pmap the axes of the mesh set with
    ``jax.set_mesh`` count as bound (a transform's init sizes its per-device
    state from them); a collective itself needs them bound by a trace.
    """
    axes = normalize(axis_name)
    names = tuple(bound_axes())
    where = "bound by shard_map's mesh or pmap's axis_name"
    current = jax.sharding.get_abstract_mesh() if mesh else None
    if current is not None and not current.empty:
        # A shard_map manual over some axes only leaves the mesh's others to init.
        extra = tuple(a for a in current.axis_names if a not in names)
        if not names:
            where = "the axes of the mesh set with jax.set_mesh"
        elif extra:
            where += ", or of the current mesh"
        names += extra
    missing = [a for a in axes if a not in names]
    if not missing:
        return axes
    bad = ", ".join(map(repr, missing)) + (" is" if len(missing) == 1 else " are")
    head = f"axis_name={axes[0]!r} is" if len(axes) == 1 else f"axis_name={axis_name!r}: {bad}"
    if not names:
        raise ValueError(
            f"{head} not bound here, and no axis is: call jaxcomm collectives inside "
            "jax.shard_map or jax.pmap over the axes axis_name names"
        )
    raise ValueError(f"{head} not bound here; the axes bound here are {names} ({where})")


def sizes(axes: tuple) -> tuple:
    check_bound(axes)
    bound = bound_axes()
    return tuple(bound[a] for a in axes)


def placement(axis_name) -> AxisPlacement:
    axes = normalize(axis_name)
    shape = sizes(axes)
    size = math.prod(shape)
    rank = lax.axis_index(axes).astype(jnp.int32)
    others = tuple(a for a in bound_axes() if a not in axes)
    group = lax.axis_index(others).astype(jnp.int32) if others else jnp.int32(0)
    return AxisPlacement(axes, shape, size, rank, group, others)


def manual_axis_type(x):
    """The manual-axis type of `x` (a value or an abstract value): which mesh
    axes it varies over inside shard_map with check_vma; None elsewhere. The
    one place that reads it, so a JAX rename is one edit."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    return getattr(aval, "manual_axis_type", None)


def reduced_type(x, axes: tuple):
    """The manual-axis type of a result that is the same on every device of `axes`."""
    mat = manual_axis_type(x)
    if mat is None:
        return None
    return mat.update(varying=mat.varying - frozenset(axes))


def is_vma_typed(x, axes: tuple) -> bool:
    """True inside shard_map(check_vma=True), where psum's transpose is a
    pvary (no communication); False under pmap / check_vma=False, where it is
    another psum."""
    mat = manual_axis_type(x)
    return mat is not None and frozenset(axes) <= mat.varying
