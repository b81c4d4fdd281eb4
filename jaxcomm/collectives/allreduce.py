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

    Call it inside ``jax.shard_map`` or ``jax.pmap``. Every device gets
    bitwise the same result, in ``x``'s dtype and shape.

    Args:
      x: array of float32, float16, bfloat16 or float64 (x64 on); any shape.
      axis_name: a mesh or pmap axis name, or a tuple of names (reduce over
        all of them). ``algorithm="hierarchical"`` takes
        ``(inter_axis, intra_axis)``.
      op: ``"sum"`` or ``"mean"``.
      algorithm: ``"ring"`` (reduce-scatter then allgather, N-1 steps each),
        ``"hierarchical"`` (reduce-scatter inside ``intra_axis``, allreduce of
        the 1/L shard across ``inter_axis``, allgather inside ``intra_axis``),
        ``"direct"`` (ffi on CPU: each rank reads its peers' memory), or
        ``"auto"`` (ffi: ``"direct"``; xla: ``lax.psum``, except with a
        16-bit wire across processes on CPU, where it is ``"ring"``: gloo adds
        float16 slowly and XLA widens a bfloat16 psum to float32; with an
        8-bit wire, the all-to-all schedule described under ``wire_dtype``).
      wire_dtype: ``None`` (send ``x.dtype``), ``jnp.float16``,
        ``jnp.bfloat16``, or an 8-bit float (below). 16-bit values travel
        in the wire dtype and are added in float32 (float64 for float64
        input) at every hop. For ``op="mean"`` the input is scaled by 1/N
        before the cast, so float16 cannot overflow for large N, and
        jaxcomm's own schedules clamp each partial sum to the float16 range.
        Exception: the xla backend's ``lax.psum`` paths (``algorithm="auto"``
        or ``"hierarchical"``) also add in the wire dtype, so their error
        grows with N; there a float16 mean is prescaled by 2^-k (2^k the
        least power of two >= 2N) and 2^k/N is applied after the reduction,
        which leaves no order of float16 additions room to overflow for
        N <= 1024 (see ``_xla.headroom_scales``); as exact as 1/N apart from
        one to two bits less subnormal range. A plain sum is not prescaled: if it
        exceeds the float16 range it comes back inf.

        ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2`` (or their names): one
        byte an element. Each device scales its input by its own power of
        two 2^e, the largest with max|x| * 2^e <= M (448 or 57344), rounds
        to 8 bits (clamped; the scale is the exponent, 2 bytes, sent along);
        an all-to-all gives each device its 1/N of every device's bytes,
        which it decodes and adds in float32, and an all-gather of the
        reduced rows (rescaled the same way) gives the result. Nothing is
        added in 8 bits and no collective is spent on the scales. Per
        element, ``|result - exact mean| <= (2u + u^2) * A`` for any N, A
        the largest finite |x| over all devices, u = 2^-4 (e4m3) or 2^-3
        (e5m2): 0.129 A or 0.266 A; N times that for a sum (float32's own
        rounding aside; A >= 2^-100). Elements far below A keep what 8 bits
        give them at A's scale. The xla backend and ``algorithm="auto"``
        only (the schedule is resolved as ``"alltoall"``; with a
        ``chunk_mask``, ``backend="auto"`` takes xla); ffi and the other
        algorithms raise ValueError. inf and NaN inputs come back non-finite
        (float8_e4m3fn has no inf: NaN).
      backend: ``"xla"`` (JAX collectives; any platform, many processes),
        ``"ffi"`` (jaxcomm's custom calls), or ``"auto"``: xla, except in one
        process on CPU (handler present) with a ``chunk_mask``, where ffi
        sends only the selected chunks, or a 16-bit wire, where ffi adds in
        float32 and XLA's CPU all-reduce in float16, several times slower.
      chunk_mask: optional boolean array of shape ``(ceil(x.size /
        chunk_size),)``, identical on every device. Only selected chunks of
        the flattened ``x`` are reduced; the others come back as the local
        values. With ffi on CPU only the selected chunks travel.
      chunk_size: elements per chunk for ``chunk_mask``.
      max_chunks: with a mask, pack at most this many selected chunks (a
        static bound, so only they travel); chunks selected beyond the bound
        are not reduced. ``None``: the xla backend reduces all chunks and
        selects afterwards, ffi on CPU packs exactly the selected ones, ffi
        on GPU packs into a buffer of all chunks (the mask stays on the
        device, and NCCL takes its sizes from the host).
      in_place: let the result reuse ``x``'s buffer: a hint for the CPU
        ffi ``"direct"`` schedule without a mask, ignored elsewhere. It
        saves writing fresh output pages when ``x`` is an intermediate, as a
        gradient in a training step is; if ``x`` is still needed (a jit
        argument, or used later) XLA copies it first, which costs more than
        it saves. ``x`` itself never changes either way.

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
