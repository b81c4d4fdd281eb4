"""The allreduce after its options are checked and bound: the per-call
checks, a chunk mask's bound, the one-device shortcut, then the backend."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives import _checks, _xla
from jaxcomm.collectives._axes import is_vma_typed


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
    place, backend = bound.place, bound.backend
    _checks.check_choice("unselected", unselected, ("local", "zero"))
    zero = chunk_mask is not None and unselected == "zero"
    if chunk_mask is not None:
        chunk_mask = jnp.asarray(chunk_mask)
        layout = bound.layout(flat.size)
        layout.check_mask(chunk_mask, max_chunks)
        if max_chunks is not None:
            # Chunks selected past the bound are not reduced: from here on
            # they are unselected (zeroed where that is asked for).
            chunk_mask = chunk_mask & (jnp.cumsum(chunk_mask, dtype=jnp.int32) <= max_chunks)
    if place.size == 1:
        # Nothing travels, so nothing is rounded to the wire dtype; every
        # backend and schedule agrees on this.
        if zero:
            flat = jnp.where(layout.elements(chunk_mask), flat, jnp.zeros((), flat.dtype))
        _, prescale, postscale = bound.scales(dtype)
        y = _xla.from_wire(flat, dtype, prescale * postscale)
        if (chunk_mask is None or zero) and is_vma_typed(y, place.axes):
            # Typed as replicated, as on more devices: a psum over one device
            # moves nothing and XLA removes it.
            y = lax.psum(y, place.axes)
        return y.reshape(shape)
    if chunk_mask is not None:
        y = backend.masked_allreduce(
            bound, flat, layout, chunk_mask, max_chunks=max_chunks, zero=zero
        )
    else:
        y = backend.allreduce(bound, flat, in_place=in_place, parts=parts)
    return y.reshape(shape)
