"""The allreduce after its options are checked and bound: one of the xla
schedules or the ffi custom call, a chunk mask, and psum's derivatives."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives import _checks, _chunks, _ffi, _fp8, _xla
from jaxcomm.collectives._axes import is_vma_typed
from jaxcomm.collectives._linear import linear_collective

_XLA_ALGORITHMS = {
    "psum": _xla.psum_allreduce,
    "ring": _xla.ring_allreduce,
    "hierarchical": _xla.hierarchical_allreduce,
}


def allreduce(
    bound,
    x,
    *,
    chunk_mask=None,
    max_chunks=None,
    unselected="local",
    in_place=False,
    parts=None,
):
    """`bound` is a :class:`jaxcomm.collectives.BoundReduction`; `x` has a
    checked dtype. `parts`: static sizes of the parts of flat `x` (the leaves
    of a bucket), which an FP8 wire scales one by one; the whole of `x` when
    None, and always with a chunk mask. The rest is as
    :func:`jaxcomm.allreduce` documents."""
    x = jnp.asarray(x)
    flat, dtype, shape = x.reshape(-1), x.dtype, jnp.shape(x)
    place, backend, algorithm = bound.place, bound.backend, bound.algorithm
    wire, prescale, postscale = bound.scales(dtype)
    chunk_size = bound.reduction.chunk_size
    _checks.check_choice("unselected", unselected, ("local", "zero"))
    zero = chunk_mask is not None and unselected == "zero"
    if chunk_mask is not None:
        chunk_mask = jnp.asarray(chunk_mask)
        nchunks = _checks.check_chunking(chunk_mask, chunk_size, flat.size, max_chunks)
        if max_chunks is not None:
            # Chunks selected past the bound are not reduced: from here on
            # they are unselected (zeroed below when that is asked for).
            chunk_mask = chunk_mask & (jnp.cumsum(chunk_mask, dtype=jnp.int32) <= max_chunks)
        if zero and (backend != "ffi" or place.size == 1):
            # Zeroed before the reduction, so the xla path unpacks into zeros
            # (the custom call zeros them itself, without a pass over x).
            selected = _chunks.elements(chunk_mask, chunk_size, flat.size)
            flat = jnp.where(selected, flat, jnp.zeros((), flat.dtype))
    if place.size == 1:
        # Nothing travels, so nothing is rounded to the wire dtype; every
        # backend and schedule agrees on this.
        y = _xla.from_wire(flat, dtype, prescale * postscale)
        if (chunk_mask is None or zero) and is_vma_typed(y, place.axes):
            # Typed as replicated, as on more devices: a psum over one device
            # moves nothing and XLA removes it.
            y = lax.psum(y, place.axes)
        return y.reshape(shape)

    def xla(v, sizes=None):
        if algorithm == _fp8.ALGORITHM:
            return _fp8.allreduce(v, place, wire, prescale, postscale, sizes)
        return _XLA_ALGORITHMS[algorithm](v, place, wire, prescale, postscale)

    def ffi(v, **options):
        return _ffi.allreduce(
            v,
            place,
            algorithm=algorithm,
            wire=wire,
            prescale=prescale,
            postscale=postscale,
            intra_size=_intra_size(place),
            **options,
        )

    if chunk_mask is not None:
        if backend == "ffi":
            y = ffi(
                flat,
                chunk_mask=chunk_mask,
                chunk_size=chunk_size,
                max_chunks=max_chunks,
                replicated=zero,
            )
        else:
            y = _masked(flat, chunk_mask, chunk_size, nchunks, max_chunks, xla, zero=zero)
        return y.reshape(shape)

    if backend == "xla" and algorithm == "psum" and wire == dtype:
        # Nothing is rounded to a wire: lax.psum's own derivatives (forward
        # mode included) are exact. A narrow wire takes linear_collective
        # below, whose backward pass is this same mean: psum's transpose would
        # cast the cotangent times postscale (2^k/N, see _xla.headroom_scales)
        # to float16, which overflows long before the cotangent does.
        return _xla.psum_allreduce(flat, place, wire, prescale, postscale).reshape(shape)

    def forward(v):
        return xla(v, parts) if backend == "xla" else ffi(v, in_place=in_place)

    # The ring's ppermutes and the custom calls would otherwise transpose to
    # something other than psum's transpose; make all schedules agree with it.
    y = linear_collective(forward, flat, place.axes, prescale * postscale, forward)
    return y.reshape(shape)


def allreduce_parts(bound, parts):
    """One ffi allreduce (CPU) over `parts`, arrays of one checked dtype, as
    if they lay one after another; returns the reduced parts, shaped as
    given. No chunk mask and no FP8 wire: those take :func:`allreduce`."""
    parts = tuple(jnp.asarray(p) for p in parts)
    place = bound.place
    wire, prescale, postscale = bound.scales(parts[0].dtype)
    if place.size == 1:
        return [allreduce(bound, p) for p in parts]

    def forward(v):
        return _ffi.allreduce_parts(
            v,
            place,
            algorithm=bound.algorithm,
            wire=wire,
            prescale=prescale,
            postscale=postscale,
            intra_size=_intra_size(place),
        )

    return list(linear_collective(forward, parts, place.axes, prescale * postscale, forward))


def _intra_size(place) -> int:
    return place.shape[-1] if len(place.axes) == 2 else 1


def _masked(flat, mask, chunk_size, nchunks, max_chunks, reduce, *, zero=False):
    """Reduces only the selected chunks of `flat` with the xla backend; the
    others keep their local values, or zeros (then the result is replicated).
    With `max_chunks`, `mask` selects at most that many chunks."""
    n = flat.size
    chunks = jnp.pad(flat, (0, nchunks * chunk_size - n)).reshape(nchunks, chunk_size)
    # Zeros typed as replicated (zeros_like would be varying), so that a zeroed
    # result is replicated like the reduction and out_specs=P() accepts it.
    rest = jnp.zeros(chunks.shape, chunks.dtype) if zero else chunks
    if max_chunks is None:
        reduced = reduce(chunks.reshape(-1)).reshape(nchunks, chunk_size)
        out = jnp.where(mask[:, None], reduced, rest)
    else:
        index = jnp.nonzero(mask, size=max_chunks, fill_value=nchunks)[0]
        packed = chunks.at[index].get(mode="fill", fill_value=0)
        reduced = reduce(packed.reshape(-1)).reshape(max_chunks, chunk_size)
        # Unpacked by a gather of each chunk's slot, which XLA fuses with the
        # unpadding; a scatter into `rest` would first write a whole pool.
        # The caller unselected the chunks past the bound, so each selected
        # chunk has a slot below max_chunks.
        slot = jnp.cumsum(mask, dtype=jnp.int32) - 1
        back = reduced.at[jnp.clip(slot, 0, max_chunks - 1)].get(mode="clip")
        out = jnp.where(mask[:, None], back, rest)
    return out.reshape(-1)[:n]
