"""Running a per-device function on N of the 8 CPU devices, and checking results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def mesh_of(shape: tuple, names: tuple):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def run_sharded(fn, mesh, *per_device, jit: bool = True):
    """Runs fn(*rows) on every device of `mesh`; each array in `per_device`
    has one leading row per device (in linear mesh order). Returns numpy
    arrays with one leading row per device."""
    axes = tuple(mesh.axis_names)
    spec = P(axes)

    def body(*blocks):
        out = fn(*(b[0] for b in blocks))
        return jax.tree.map(lambda o: o[None], out)

    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    f = jax.jit(f) if jit else f
    args = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec)) for a in per_device]
    return jax.tree.map(np.asarray, jax.block_until_ready(f(*args)))


def run_pmap(fn, n: int, *per_device, axis_name="i"):
    f = jax.pmap(fn, axis_name=axis_name, devices=jax.devices()[:n])
    return jax.tree.map(np.asarray, jax.block_until_ready(f(*per_device)))


def assert_replicated(rows: np.ndarray):
    """Every device holds bitwise the same result."""
    rows = np.ascontiguousarray(rows)
    first = rows[0].tobytes()
    for i, row in enumerate(rows[1:], 1):
        assert row.tobytes() == first, f"device {i} differs from device 0"
