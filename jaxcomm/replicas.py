"""Do the devices of an axis hold the same values? The replica check.

Data-parallel training relies on every device holding bitwise the same
parameters and optimizer state after every step (docs/design.md,
"Invariants"). :func:`check_replicas` measures it inside ``jax.shard_map`` or
``jax.pmap``; :func:`check_replicas_host` does the same on the host for an
array gathered with one leading row per device.

Two numbers per leaf, because they answer different questions:

- ``mismatches``: elements whose *bits* differ between some two devices
  (values compared as unsigned integers of their width). Exact: 0 means
  bitwise identical, including signed zeros and NaN payloads. Use it to
  assert identity.
- ``max_abs_diff``: the largest ``|x_i - x_j|`` over devices and elements,
  computed as ``pmax(x) - pmin(x)`` in float32 (float64 for float64 and
  64-bit integers), and 0 where the bits agree. Use it to see how far apart
  replicas drifted. It can be 0 while ``mismatches`` is not (``+0.0`` vs
  ``-0.0``, or subnormals on a backend that flushes them), is ``inf`` when
  one device holds an inf the others do not, and NaN when one holds a NaN
  the others do not.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["ReplicaDiff", "check_replicas", "check_replicas_host"]


class ReplicaDiff(NamedTuple):
    """How far apart the replicas of a pytree are (see the module docstring).

    Attributes:
      max_abs_diff: a tree like the input with one float scalar per leaf,
        the largest absolute difference between devices (0 where bitwise equal).
      mismatches: a tree like the input with one int32 scalar per leaf, the
        number of elements whose bits differ between devices.
    """

    max_abs_diff: Any
    mismatches: Any

    def worst(self) -> tuple:
        """(largest ``max_abs_diff`` over all leaves, total ``mismatches``).

        NaN wins over numbers; an empty tree gives ``(0.0, 0)``.
        """
        diffs = jax.tree.leaves(self.max_abs_diff)
        counts = jax.tree.leaves(self.mismatches)
        if not diffs:
            return 0.0, 0
        on_host = all(isinstance(x, (np.ndarray, np.generic)) for x in diffs)
        xp = np if on_host else jnp
        return xp.max(xp.stack(diffs)), sum(counts[1:], counts[0])


def _bits(x):
    """x as unsigned integers of the same width (complex: real and imag parts)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)])
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    width = jnp.dtype(x.dtype).itemsize * 8
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}"))


def _wide(x):
    """x in a type where pmax - pmin of its values is meaningful."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)])
    wide = jnp.float64 if jnp.dtype(x.dtype).itemsize == 8 else jnp.float32
    return x.astype(wide)


def _leaf_diff(x, axes):
    x = jnp.asarray(x)
    if x.size == 0:
        return jnp.float32(0), jnp.int32(0)
    bits = _bits(x)
    differ = lax.pmax(bits, axes) != lax.pmin(bits, axes)
    wide = _wide(x)
    spread = jnp.where(differ, jnp.abs(lax.pmax(wide, axes) - lax.pmin(wide, axes)), 0)
    return jnp.max(spread), jnp.sum(differ, dtype=jnp.int32)


def check_replicas(tree, axis_name) -> ReplicaDiff:
    """Compares every leaf of ``tree`` across the devices of ``axis_name``.

    Call it inside ``jax.shard_map`` or ``jax.pmap`` over ``axis_name`` (a
    name or a tuple of names). Its results are the same on every device
    (typed as replicated over ``axis_name``), so they can leave ``shard_map``
    with ``out_specs=P()``. Costs two max-allreduces and two min-allreduces
    per leaf (its bits and its values), all XLA collectives.

    Args:
      tree: a pytree of arrays (float, integer, bool or complex).
      axis_name: the mesh or pmap axis (or tuple of axes) to compare over.

    Returns:
      A :class:`ReplicaDiff`: per-leaf ``max_abs_diff`` and ``mismatches``;
      ``.worst()`` folds them into two scalars.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from jaxcomm.replicas import check_replicas
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> def check(rows):
      ...     x = rows[0]  # this device's row
      ...     zero = (x - 1).astype(jnp.bfloat16) * 0  # -0.0 on device 0, +0.0 elsewhere
      ...     return check_replicas({"same": x * 0 + 1.5, "skewed": x, "zero": zero}, "data")
      >>> rows = jnp.arange(jax.device_count(), dtype=jnp.float32)[:, None] * jnp.ones(3)
      >>> rows = jax.device_put(rows, NamedSharding(mesh, P("data")))
      >>> diff = jax.jit(jax.shard_map(check, mesh=mesh, in_specs=P("data"), out_specs=P()))(rows)
      >>> float(diff.max_abs_diff["same"]), int(diff.mismatches["same"])
      (0.0, 0)
      >>> float(diff.max_abs_diff["skewed"]) == jax.device_count() - 1
      True
      >>> int(diff.mismatches["skewed"])  # all 3 elements differ somewhere
      3
      >>> float(diff.max_abs_diff["zero"]), int(diff.mismatches["zero"])  # equal, not bitwise
      (0.0, 3)
    """
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else axis_name
    return _per_leaf(lambda x: _leaf_diff(x, axes), tree)


def check_replicas_host(tree) -> ReplicaDiff:
    """:func:`check_replicas` on the host, for leaves with a leading device axis.

    Each leaf is an array of shape ``(devices, ...)``, e.g. a state gathered
    with ``np.asarray`` after a ``shard_map`` whose ``out_specs`` put one row
    per device, or the output of ``jax.pmap``. Same numbers as the device
    version: bits compared exactly, differences in float64.

    Examples:
      >>> import numpy as np
      >>> from jaxcomm.replicas import check_replicas_host
      >>> rows = {"w": np.array([[1.0, 2.0], [1.0, 2.5]], np.float32), "b": np.zeros((2, 0))}
      >>> diff = check_replicas_host(rows)
      >>> float(diff.max_abs_diff["w"]), int(diff.mismatches["w"]), int(diff.mismatches["b"])
      (0.5, 1, 0)
      >>> [float(x) for x in diff.worst()]
      [0.5, 1.0]
    """

    def leaf(x):
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError("check_replicas_host needs a leading device axis on every leaf")
        if x.size == 0 or x.shape[0] == 0:
            return np.float64(0), np.int32(0)
        if np.iscomplexobj(x):
            x = np.stack([x.real, x.imag], axis=1)
        bits = np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}") if x.dtype != bool else x
        differ = np.any(bits != bits[:1], axis=0)
        values = x.astype(np.float64)
        with np.errstate(invalid="ignore"):
            spread = np.where(differ, np.abs(values.max(0) - values.min(0)), 0.0)
        return np.float64(spread.max(initial=0.0) if spread.size else 0.0), np.int32(differ.sum())

    return _per_leaf(leaf, tree)


def _per_leaf(diff, tree) -> ReplicaDiff:
    leaves, treedef = jax.tree.flatten(tree)
    pairs = [diff(x) for x in leaves]
    return ReplicaDiff(
        max_abs_diff=treedef.unflatten([p[0] for p in pairs]),
        mismatches=treedef.unflatten([p[1] for p in pairs]),
    )
