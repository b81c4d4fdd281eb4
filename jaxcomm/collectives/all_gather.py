"""all_gather: every device gets every device's array, in rank order."""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomm.collectives import _prepare


def all_gather(x, axis_name, *, wire_dtype=None, backend: str = "auto"):
    """Stacks ``x`` from every device of ``axis_name``.

    Args:
      x: float32, float16, bfloat16 or float64 array, same shape everywhere.
      axis_name: axis name or tuple of names; rank order is the linear index.
      wire_dtype: ``None`` or a narrower float dtype to send (rounds values;
        every device, the sender included, sees the rounded values).
      backend: ``"xla"`` (``lax.all_gather``), ``"ffi"`` (ring) or ``"auto"``:
        ffi for a 16-bit wire in one process on CPU, as
        :func:`jaxcomm.allreduce`; xla otherwise.

    Returns:
      An array of shape ``(N, *x.shape)`` in ``x.dtype``.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> n = jax.device_count()
      >>> mesh = jax.make_mesh((n,), ("data",))
      >>> f = jax.shard_map(lambda x: jaxcomm.all_gather(x, "data"),
      ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> x = jax.device_put(jnp.arange(1.0 * n), jax.sharding.NamedSharding(mesh, P("data")))
      >>> jax.jit(f)(x).shape == (n, 1)
      True
    """
    flat, bound = _prepare.prepare(x, axis_name, op="sum", wire_dtype=wire_dtype, backend=backend)
    out = bound.backend.all_gather(bound, flat)
    return out.reshape((bound.size, *jnp.shape(x)))
