"""reduce_scatter: each device gets its 1/N slice of the sum (or mean)."""

from __future__ import annotations

from jaxcomm.collectives import _prepare


def reduce_scatter(x, axis_name, *, op: str = "sum", wire_dtype=None, backend: str = "auto"):
    """Reduces ``x`` over ``axis_name`` and keeps this device's slice.

    The flattened input is zero-padded to a multiple of N and cut into N
    slices of S = ceil(x.size / N) elements; rank r (its linear index over
    ``axis_name``) gets slice r of the sum. Scales, casts and the wire dtype
    follow :func:`jaxcomm.allreduce`.

    Args:
      x: float32, float16, bfloat16 or float64 array, any shape.
      axis_name: axis name or tuple of names.
      op: ``"sum"`` or ``"mean"``.
      wire_dtype: ``None``, ``jnp.float16`` or ``jnp.bfloat16``.
      backend: ``"xla"`` (``lax.psum_scatter``), ``"ffi"`` (ring) or ``"auto"``:
        ffi for a 16-bit wire in one process on CPU, as
        :func:`jaxcomm.allreduce`; xla otherwise.

    Returns:
      A 1-D array of S elements in ``x.dtype``.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> n = jax.device_count()
      >>> mesh = jax.make_mesh((n,), ("data",))
      >>> f = jax.shard_map(lambda x: jaxcomm.reduce_scatter(x, "data"),
      ...                   mesh=mesh, in_specs=P("data"), out_specs=P("data"))
      >>> x = jax.device_put(jnp.ones((n * n,)),  # each device holds n ones
      ...                    jax.sharding.NamedSharding(mesh, P("data")))
      >>> bool((jax.jit(f)(x) == n).all())
      True
    """
    flat, bound = _prepare.prepare(x, axis_name, op=op, wire_dtype=wire_dtype, backend=backend)
    return bound.backend.reduce_scatter(bound, flat)
