"""The `xla` backend: jaxcomm collectives from JAX's own collectives.

Portable (CPU, GPU, TPU, several processes). Everything here works on flat
1-D arrays; the front ends reshape. Scales and casts follow the shared
contract: cast(x * prescale) travels, the reduced value is multiplied by
postscale and cast back.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives._axes import AxisPlacement, is_vma_typed


def accumulator(dtype) -> jnp.dtype:
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def to_wire(x, wire, prescale: float):
    acc = accumulator(x.dtype)
    if prescale != 1.0:
        x = x.astype(acc) * prescale
    return x.astype(wire)


def saturate(v, wire, prescale: float):
    """Clamps finite values to the wire's range before a prescaled (mean)
    partial sum is rounded to it, as the C++ schedules do (ReduceSpec::saturate):
    such sums only overflow by rounding up. inf and NaN pass."""
    if prescale == 1.0:
        return v
    hi = float(jnp.finfo(wire).max)
    return jnp.where(jnp.isinf(v), v, jnp.clip(v, -hi, hi))


def from_wire(y, dtype, postscale: float):
    if postscale != 1.0:
        y = y.astype(accumulator(dtype)) * postscale
    return y.astype(dtype)


def _pad_to(x, multiple: int):
    padded = -(-x.size // multiple) * multiple
    return jnp.pad(x, (0, padded - x.size)) if padded != x.size else x


def psum_allreduce(x, place: AxisPlacement, wire, prescale, postscale):
    """XLA's all-reduce. A narrow wire dtype is also what XLA adds in: each
    hop rounds to it, so the error bound is looser than the ring's."""
    return from_wire(lax.psum(to_wire(x, wire, prescale), place.axes), x.dtype, postscale)


def ring_allreduce(x, place: AxisPlacement, wire, prescale, postscale):
    """The ring of xla_ffi/algorithm/schedule.cc, step for step, from ppermute.

    Reduce-scatter: step s sends chunk r-s-1 right and adds chunk r-s-2 from
    the left, in the accumulator type; the wire type is only what travels.
    The allgather of the reduced chunks is lax.all_gather, which moves the
    same bytes and leaves a result typed as replicated over the axes.
    """
    n, size, r = x.size, place.size, place.rank
    acc_t = accumulator(x.dtype)
    acc = (_pad_to(x, size).astype(acc_t) * prescale).reshape(size, -1)
    right = [(i, (i + 1) % size) for i in range(size)]
    for s in range(size - 1):
        send = lax.dynamic_index_in_dim(acc, (r - s - 1) % size, keepdims=False)
        recv = lax.ppermute(saturate(send, wire, prescale).astype(wire), place.axes, right)
        at = (r - s - 2) % size
        mine = lax.dynamic_index_in_dim(acc, at, keepdims=False)
        acc = lax.dynamic_update_index_in_dim(acc, mine + recv.astype(acc_t), at, 0)
    own = saturate(lax.dynamic_index_in_dim(acc, r, keepdims=False), wire, prescale)
    own = (own * postscale).astype(wire) if postscale != 1.0 else own.astype(wire)
    to = "invarying" if is_vma_typed(own, place.axes) else "varying"
    gathered = lax.all_gather(own, place.axes, tiled=True, to=to)
    return gathered[:n].astype(x.dtype)


def hierarchical_allreduce(x, place: AxisPlacement, wire, prescale, postscale):
    """Reduce-scatter inside the node, allreduce of the 1/L shard across nodes,
    allgather inside the node. `place.axes` is (inter_axis, intra_axis)."""
    inter, intra = place.axes
    local = lax.axis_size(intra)
    n = x.size
    w = _pad_to(to_wire(x, wire, prescale), local).reshape(local, -1)
    shard = lax.psum_scatter(w, intra, scatter_dimension=0, tiled=False)
    shard = lax.psum(shard, inter)
    # Typed as replicated over both axes, like psum's result.
    to = "invarying" if is_vma_typed(shard, (intra,)) else "varying"
    full = lax.all_gather(shard, intra, tiled=True, to=to)
    return from_wire(full[:n], x.dtype, postscale)


def reduce_scatter(x, place: AxisPlacement, wire, prescale, postscale):
    w = _pad_to(to_wire(x, wire, prescale), place.size).reshape(place.size, -1)
    shard = lax.psum_scatter(w, place.axes, scatter_dimension=0, tiled=False)
    return from_wire(shard, x.dtype, postscale)


def all_gather(x, place: AxisPlacement, wire):
    # Typed as replicated over the axes, like the ffi backend's result.
    to = "invarying" if is_vma_typed(x, place.axes) else "varying"
    return lax.all_gather(x.astype(wire), place.axes, tiled=False, to=to).astype(x.dtype)
