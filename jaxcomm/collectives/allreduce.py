"""allreduce: every device gets the sum (or mean) of all devices' arrays."""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomm.collectives import _checks
from jaxcomm.collectives.reduction import DEFAULT_CHUNK_SIZE, reduction


def allreduce(
    x,
    axis_name,
    *,
    op: str = "sum",
    algorithm: str = "auto",
    wire_dtype=None,
    backend: str = "auto",
    chunk_mask=None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_chunks: int | None = None,
    unselected: str = "local",
    in_place: bool = False,
):
    """Sums (or averages) ``x`` over the devices of ``axis_name``.

    Call it inside ``jax.shard_map`` or ``jax.pmap``. With N devices, every
    device gets ``y = sum_j x_j`` (``op="mean"``: ``y / N``), bitwise the same, in
    ``x``'s dtype and shape. A 16-bit ``wire_dtype`` sends the ``x_j`` in 16 bits,
    added in float32 by jaxcomm's own schedules (by ``lax.psum`` in 16 bits);
    an 8-bit float one scales each device's ``x_j`` by a power of two, adds in
    float32 and errs per element by at most ``(2u + u^2) * A`` for any N (A the
    largest finite ``|x|``, u = 2^-4 for e4m3, 2^-3 for e5m2; N times that for a
    sum); ``"int8"`` / ``"int4"`` scale each chunk of 256 elements and err by at
    most ``A / Q``, Q = 127 and 7 (A over the 510 elements either side; a chunk
    with an inf or NaN comes back NaN). See
    docs/design.md, "Mean, sum and the narrow wire", "8-bit wires", "Integer wires".

    Args:
      x: array of float32, float16, bfloat16 or float64 (x64 on); any shape.
      axis_name: a mesh or pmap axis name, or a tuple of names (reduce over all
        of them); ``(inter_axis, intra_axis)`` for ``algorithm="hierarchical"``.
      op: ``"sum"`` (default) or ``"mean"``.
      algorithm: ``"ring"``, ``"hierarchical"``, ``"direct"`` (ffi on CPU) or
        ``"auto"``: ffi ``"direct"``; xla ``lax.psum``, the ring for a 16-bit wire
        across CPU processes, ``"alltoall"`` for an 8- or 4-bit wire (docs/design.md).
      wire_dtype: ``None`` (send ``x.dtype``), ``jnp.float16``, ``jnp.bfloat16``,
        ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``, ``jnp.int8`` or ``jnp.int4`` (or
        their names; 8- and 4-bit: xla backend and ``algorithm="auto"`` only, else
        ValueError). A 16-bit mean is
        prescaled so float16 cannot overflow; a sum is not (float16: inf past 65504).
      backend: ``"xla"`` (JAX collectives; any platform, many processes), ``"ffi"``
        (jaxcomm's custom calls) or ``"auto"``: xla, but ffi in one CPU process
        for a ``chunk_mask`` or a 16-bit wire (docs/design.md, "Two backends").
      chunk_mask: optional bool array, one per ``chunk_size`` elements of the
        flattened ``x``, the same on every device: only selected chunks are reduced.
      chunk_size: elements per chunk for ``chunk_mask``.
      max_chunks: with a mask, a static bound on the selected chunks packed and
        reduced; ``None``: see docs/design.md, "Chunk-sparse communication".
      unselected: what unselected chunks hold: ``"local"`` (default) the input,
        ``"zero"`` zeros (the result is then the same on every device).
      in_place: let the result reuse ``x``'s buffer, a hint for ffi ``"direct"`` on
        CPU without a mask (docs/design.md, "The CPU transport").

    Returns:
      The reduced array, same shape and dtype as ``x``.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> f = jax.shard_map(lambda x: jaxcomm.allreduce(x, "data", op="mean"),
      ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> x = jax.device_put(jnp.arange(2.0 * jax.device_count()),
      ...                    jax.sharding.NamedSharding(mesh, P("data")))
      >>> bool(jnp.allclose(jax.jit(f)(x), x.reshape(-1, 2).mean(0)))
      True
    """
    x = jnp.asarray(x)
    _checks.check_input_dtype("x", x.dtype)
    bound = reduction(
        axis_name,
        op=op,
        wire_dtype=wire_dtype,
        algorithm=algorithm,
        backend=backend,
        masked=chunk_mask is not None,
        chunk_size=chunk_size,
    ).bind()
    return bound.allreduce(
        x, chunk_mask=chunk_mask, max_chunks=max_chunks, unselected=unselected, in_place=in_place
    )
