"""Typing values as different on every device, so that JAX keeps them local.

Under ``shard_map`` (with ``check_vma=True``, the default) every value has a
type that says over which mesh axes it may differ. ``jax.grad`` with respect
to params typed as the same on every device sums the gradient over those
devices itself, the transpose of that sameness. jaxcomm's transforms want the
local gradient, so params are first typed as varying: a ``lax.pcast``, which
moves no data.
"""

from __future__ import annotations

import jax
from jax import lax

from jaxcomm.collectives._axes import manual_axis_type, normalize, sizes


def to_varying(tree, axis_name):
    """Types every leaf of ``tree`` as varying over ``axis_name``.

    Leaves already varying over some of the axes are cast over the others
    only. Under ``jax.pmap`` or ``shard_map(check_vma=False)``, where values
    carry no such type, it returns ``tree`` as it is.

    Args:
      tree: a pytree of arrays.
      axis_name: a mesh axis name bound here, or a tuple of them.

    Raises:
      ValueError: an axis is not bound here (outside shard_map / pmap).

    Returns:
      ``tree`` with every leaf typed as varying over ``axis_name``.
    """
    axes = normalize(axis_name)
    sizes(axes)  # a clear error where an axis is not bound

    def one(x):
        mat = manual_axis_type(x)
        if mat is None:
            return x
        missing = tuple(a for a in axes if a not in mat.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def varying_axes(x) -> tuple:
    """The mesh axes ``x`` is typed as varying over, sorted; () outside
    ``shard_map`` with ``check_vma`` (and under ``jax.pmap``).

    Args:
      x: an array, a tracer or an abstract value (``jax.typeof(x)``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomm.collectives import varying_axes
      >>> varying_axes(jnp.zeros(3))
      ()
    """
    mat = manual_axis_type(x)
    return tuple(sorted(mat.varying)) if mat is not None else ()
