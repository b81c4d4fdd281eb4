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


# The allreduce algorithms whose partial sums XLA adds in the wire dtype
# (lax.psum, lax.psum_scatter); reduce_scatter's xla path is one too.
ADDS_IN_WIRE = ("psum", "hierarchical")


def headroom_scales(wire, size: int, prescale: float, postscale: float) -> tuple[float, float]:
    """(prescale, postscale) for the paths where XLA adds in the wire dtype,
    where nothing can clamp a partial sum as :func:`saturate` does.

    A float16 mean is prescaled by 2^-k instead of 1/N, 2^k the least power
    of two >= 2N, and 2^k/N joins the postscale, applied in the accumulator
    type after the reduction. The 1/N prescale has no headroom:
    3 * fl16(65504/3) = 3 * 21840 = 65520 rounds to inf. Scaling by a power
    of two is exact, so the result is as accurate as with 1/N, except that
    inputs below 2^-14 * 2^k (instead of 2^-14 * N) are subnormal on the
    wire: 2^k/N is in [2, 4), one to two bits less subnormal range.

    bfloat16 has float32's exponent range and needs no headroom; a plain sum
    (prescale 1) is left alone, so its real overflow still comes back inf.
    """
    if prescale == 1.0 or jnp.dtype(wire) != jnp.float16:
        return prescale, postscale
    # Why no order of additions can overflow, for N <= 1420: with |g_i| <= M
    # = 65504, each term |fl16(g_i * 2^-k)| <= M / 2^k <= M / (2N) (M * 2^-k
    # is a float16 value and rounding is monotone), so the exact sum of any
    # subset of terms is at most M/2. A float16 addition rounds to nearest,
    # |fl(a + b)| <= (1 + u)(|a| + |b|) with u = 2^-11, so a partial sum that
    # went through at most N - 1 additions, in any order (a chain, a tree,
    # XLA's own), is at most (1 + u)^(N-1) * M/2 < M while (1 + u)^(N-1) < 2,
    # i.e. N <= 1420; for N = 1024 it is 0.83 M. First order: the rounding
    # error is at most (N-1) * u * M/2 < M/4.
    power = float(1 << (2 * size - 1).bit_length())
    return 1.0 / power, prescale * postscale * power


def from_wire(y, dtype, postscale: float):
    if postscale != 1.0:
        y = y.astype(accumulator(dtype)) * postscale
    return y.astype(dtype)


def _as_bits(x):
    """16-bit floats travel as their bits (uint16): XLA's CPU compiler widens
    a bfloat16 collective-permute or all-gather to float32, which doubles the
    bytes on the wire (visible in the compiled HLO), and moving bits needs no
    arithmetic in the wire type."""
    return lax.bitcast_convert_type(x, jnp.uint16) if jnp.dtype(x.dtype).itemsize == 2 else x


def _from_bits(x, dtype):
    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _ppermute(x, axes, perm):
    return _from_bits(lax.ppermute(_as_bits(x), axes, perm), x.dtype)


def _all_gather(x, axes, *, to: str):
    """Tiled all-gather of the ring's and the hierarchy's reduced shards."""
    return _from_bits(lax.all_gather(_as_bits(x), axes, tiled=True, to=to), x.dtype)


def _pad_to(x, multiple: int):
    padded = -(-x.size // multiple) * multiple
    return jnp.pad(x, (0, padded - x.size)) if padded != x.size else x


def psum_allreduce(x, place: AxisPlacement, wire, prescale, postscale):
    """XLA's all-reduce. A narrow wire dtype is also what XLA adds in: each
    hop rounds to it, so the error bound is looser than the ring's, and a
    float16 mean is prescaled with headroom (:func:`headroom_scales`)."""
    prescale, postscale = headroom_scales(wire, place.size, prescale, postscale)
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
        recv = _ppermute(saturate(send, wire, prescale).astype(wire), place.axes, right)
        at = (r - s - 2) % size
        mine = lax.dynamic_index_in_dim(acc, at, keepdims=False)
        acc = lax.dynamic_update_index_in_dim(acc, mine + recv.astype(acc_t), at, 0)
    own = saturate(lax.dynamic_index_in_dim(acc, r, keepdims=False), wire, prescale)
    own = (own * postscale).astype(wire) if postscale != 1.0 else own.astype(wire)
    to = "invarying" if is_vma_typed(own, place.axes) else "varying"
    gathered = _all_gather(own, place.axes, to=to)
    return gathered[:n].astype(x.dtype)


def hierarchical_allreduce(x, place: AxisPlacement, wire, prescale, postscale):
    """Reduce-scatter inside the node, allreduce of the 1/L shard across nodes,
    allgather inside the node. `place.axes` is (inter_axis, intra_axis).
    XLA adds in the wire dtype, as in :func:`psum_allreduce`."""
    prescale, postscale = headroom_scales(wire, place.size, prescale, postscale)
    inter, intra = place.axes
    local = lax.axis_size(intra)
    n = x.size
    w = _pad_to(to_wire(x, wire, prescale), local).reshape(local, -1)
    shard = lax.psum_scatter(w, intra, scatter_dimension=0, tiled=False)
    shard = lax.psum(shard, inter)
    # Typed as replicated over both axes, like psum's result.
    to = "invarying" if is_vma_typed(shard, (intra,)) else "varying"
    full = _all_gather(shard, intra, to=to)
    return from_wire(full[:n], x.dtype, postscale)


def reduce_scatter(x, place: AxisPlacement, wire, prescale, postscale):
    """lax.psum_scatter, which adds in the wire dtype as :func:`psum_allreduce` does."""
    prescale, postscale = headroom_scales(wire, place.size, prescale, postscale)
    w = _pad_to(to_wire(x, wire, prescale), place.size).reshape(place.size, -1)
    shard = lax.psum_scatter(w, place.axes, scatter_dimension=0, tiled=False)
    return from_wire(shard, x.dtype, postscale)


def all_gather(x, place: AxisPlacement, wire):
    # Typed as replicated over the axes, like the ffi backend's result.
    to = "invarying" if is_vma_typed(x, place.axes) else "varying"
    return lax.all_gather(x.astype(wire), place.axes, tiled=False, to=to).astype(x.dtype)
