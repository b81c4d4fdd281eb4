"""allreduce: every device gets the sum (or mean) of all devices' arrays."""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomm.collectives import _checks, _ffi, _xla
from jaxcomm.collectives._frontend import (
    DEFAULT_CHUNK_SIZE,
    linear_collective,
    prepare,
    resolve_algorithm,
)

_XLA_ALGORITHMS = {
    "psum": _xla.psum_allreduce,
    "ring": _xla.ring_allreduce,
    "hierarchical": _xla.hierarchical_allreduce,
}


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
        ``"auto"`` (ffi: ``"direct"``; xla: ``lax.psum``).
      wire_dtype: ``None`` (send ``x.dtype``), ``jnp.float16`` or
        ``jnp.bfloat16``. Values travel in the wire dtype and are added in
        float32 (float64 for float64 input) at every hop. For ``op="mean"``
        the input is scaled by 1/N before the cast, so float16 cannot
        overflow for large N, and jaxcomm's own schedules clamp each partial
        sum to the float16 range. Exception: the xla backend's ``lax.psum``
        paths (``algorithm="auto"`` or ``"hierarchical"``) also add in the
        wire dtype, so their error grows with N; there a float16 mean is
        prescaled by 2^-k (2^k the least power of two >= 2N) and 2^k/N is
        applied after the reduction, which leaves no order of float16
        additions room to overflow for N <= 1024 (see
        ``_xla.headroom_scales``); as exact as 1/N apart from one to two
        bits less subnormal range. A plain sum is not prescaled: if it
        exceeds the float16 range it comes back inf.
      backend: ``"xla"`` (JAX collectives; any platform, many processes),
        ``"ffi"`` (jaxcomm's custom calls), or ``"auto"``: xla, except with a
        ``chunk_mask`` where ffi (one process, handler present) sends only
        the selected chunks.
      chunk_mask: optional boolean array of shape ``(ceil(x.size /
        chunk_size),)``, identical on every device. Only selected chunks of
        the flattened ``x`` are reduced; the others come back as the local
        values. With ffi only the selected chunks travel.
      chunk_size: elements per chunk for ``chunk_mask``.
      max_chunks: xla backend with a mask: pack at most this many selected
        chunks (a static bound, so only they travel); ``None`` reduces all
        chunks and selects afterwards. Chunks selected beyond the bound are
        not reduced.
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
    c = prepare(
        x, axis_name, op=op, wire_dtype=wire_dtype, backend=backend, masked=chunk_mask is not None
    )
    flat, dtype, wire, backend, place, prescale, postscale = c
    axes = place.axes
    algorithm = resolve_algorithm(algorithm, backend, axes)
    shape = jnp.shape(x)
    _checks.check_choice("unselected", unselected, ("local", "zero"))
    zero = chunk_mask is not None and unselected == "zero"
    if chunk_mask is not None:
        chunk_mask = jnp.asarray(chunk_mask)
        nchunks = _checks.check_chunking(chunk_mask, chunk_size, flat.size, max_chunks)
        if zero:
            # Zeroed before the call, so the custom call's result is the same
            # on every device and the xla path unpacks into zeros.
            selected = jnp.repeat(chunk_mask, chunk_size, total_repeat_length=nchunks * chunk_size)
            flat = jnp.where(selected[: flat.size], flat, jnp.zeros((), flat.dtype))
    if place.size == 1:
        # Nothing travels, so nothing is rounded to the wire dtype; every
        # backend and schedule agrees on this.
        return _xla.from_wire(flat, dtype, prescale * postscale).reshape(shape)

    if chunk_mask is not None:
        if backend == "ffi":
            y = _ffi.allreduce(
                flat,
                place,
                algorithm=algorithm,
                wire=wire,
                prescale=prescale,
                postscale=postscale,
                chunk_mask=chunk_mask,
                chunk_size=chunk_size,
                intra_size=_intra_size(place),
                replicated=zero,
            )
        else:
            reduce = _XLA_ALGORITHMS[algorithm]
            y = _masked(
                flat,
                chunk_mask,
                chunk_size,
                nchunks,
                max_chunks,
                lambda v: reduce(v, place, wire, prescale, postscale),
                zero=zero,
            )
        return y.reshape(shape)

    if backend == "xla" and algorithm == "psum" and wire == dtype:
        # Nothing is rounded to a wire: lax.psum's own derivatives (forward
        # mode included) are exact. A narrow wire takes linear_collective
        # below, whose backward pass is this same mean: psum's transpose would
        # cast the cotangent times postscale (2^k/N, see _xla.headroom_scales)
        # to float16, which overflows long before the cotangent does.
        return _xla.psum_allreduce(flat, place, wire, prescale, postscale).reshape(shape)

    def forward(v):
        if backend == "xla":
            return _XLA_ALGORITHMS[algorithm](v, place, wire, prescale, postscale)
        return _ffi.allreduce(
            v,
            place,
            algorithm=algorithm,
            wire=wire,
            prescale=prescale,
            postscale=postscale,
            intra_size=_intra_size(place),
            in_place=in_place,
        )

    # The ring's ppermutes and the custom calls would otherwise transpose to
    # something other than psum's transpose; make all schedules agree with it.
    y = linear_collective(forward, flat, axes, prescale * postscale, forward)
    return y.reshape(shape)


def _intra_size(place) -> int:
    return place.shape[-1] if len(place.axes) == 2 else 1


def _masked(flat, mask, chunk_size, nchunks, max_chunks, reduce, *, zero=False):
    """Reduces only the selected chunks of `flat` with the xla backend; the
    others keep their local values, or zeros (then the result is replicated)."""
    n = flat.size
    chunks = jnp.pad(flat, (0, nchunks * chunk_size - n)).reshape(nchunks, chunk_size)
    rest = jnp.zeros_like(chunks) if zero else chunks
    if max_chunks is None:
        reduced = reduce(chunks.reshape(-1)).reshape(nchunks, chunk_size)
        out = jnp.where(mask[:, None], reduced, rest)
    else:
        index = jnp.nonzero(mask, size=max_chunks, fill_value=nchunks)[0]
        packed = chunks.at[index].get(mode="fill", fill_value=0)
        reduced = reduce(packed.reshape(-1)).reshape(max_chunks, chunk_size)
        out = rest.at[index].set(reduced, mode="drop")
    return out.reshape(-1)[:n]
