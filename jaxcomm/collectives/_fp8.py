"""FP8 wires: a power-of-two scale per device and part, a reduce-scatter by
all-to-all and an all-gather, every addition in float32.

An 8-bit float has too little range to take gradients as they come and too
little precision to add in, so an FP8 wire is never handed to lax.psum:

1. Each device scales each part of its input (a leaf of a bucket, or the
   whole input) by its own power of two 2^e, the largest with
   A * 2^e <= M, where A is the part's largest finite |x| on this device and
   M the format's largest finite value (448 for float8_e4m3fn, 57344 for
   float8_e5m2), and rounds it to the format (clamped to +-M; inf and NaN
   pass, and float8_e4m3fn, which has no inf, makes inf NaN).
2. An all-to-all sends row j of the result, with every part's exponent (2
   bytes each), to device j, which decodes the N rows in float32 (float64 for
   float64 input), adds them and applies 1/N for a mean (so that a mean of
   finite values is finite: _add_rows).
3. Device j rounds its reduced row to the format the same way (one exponent
   for the row) and an all-gather gives every device every row, which every
   device decodes the same way.

The exponents are local: no collective is spent on them, and what a device's
cast drops is known to it alone (:func:`cast_error`, for error feedback).
The bytes are the ring's: each device sends (N-1)/N of the input in each of
the two collectives, plus the exponents.

Error bound. Let u be the format's unit roundoff (2^-4 for float8_e4m3fn,
2^-3 for float8_e5m2), m its smallest normal value (2^-6, 2^-14) and A the
largest finite |x| of a part over all devices. Rounding to nearest gives
|fl(t) - t| <= u * max(|t|, m). A device's scaled values reach
A_i * 2^e > M/2, so below m they are at most 2m/M < 2^-13 of A_i: each
decoded input is within u * A_i <= u * A of x_i, and their mean within
u * A of the true mean, which it exceeds by at most u * A in magnitude. The
second rounding adds u * (1 + u) * A. So, per element, for a mean

    |y - mean(x)| <= (2u + u^2) * A,

independent of N (0.129 A for float8_e4m3fn, 0.266 A for float8_e5m2), and N
times that for a sum, up to float32's own rounding (relative 2^-24) and as
long as the scale 2^e stays within the accumulator type: A between 2^-100
and the type's largest value. Elements much smaller than A keep only the
bits the format gives them at A's scale, which is what the bound says.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.collectives._axes import AxisPlacement, is_vma_typed

WIRES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
ALGORITHM = "alltoall"  # the resolved schedule of an FP8 wire
_EXPONENT = jnp.int16  # a scale travels as its exponent: 2 bytes


def scale_bytes(size: int, parts: int = 1) -> int:
    """What the exponents add to the payload of a bucket of `parts` parts,
    counted as payload is (bytes_sent = 2(N-1)/N x payload): each device
    sends each of its N-1 peers 2 bytes per part with its all-to-all row and
    2 bytes with its gathered row, 2(N-1)(parts + 1) bytes = 2(N-1)/N x
    N(parts + 1)."""
    return size * (parts + 1)


def _accumulator(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def exponent(values, wire):
    """The e of :func:`encode` for `values` (one part): the largest with
    max|finite values| * 2^e <= M, found exactly from the binary exponents;
    0 for a part of zeros (any scale sends zeros exactly)."""
    biggest = jnp.max(jnp.where(jnp.isfinite(values), jnp.abs(values), 0), initial=0)
    top_mantissa, top_exp = np.frexp(float(jnp.finfo(wire).max))  # 0.875 for both formats
    mantissa, exp = jnp.frexp(biggest)
    e = top_exp - exp - (mantissa > top_mantissa).astype(exp.dtype)
    return jnp.where(biggest > 0, e, 0).astype(_EXPONENT)


def _pow2(e, dtype):
    """(2^floor(e/2), 2^ceil(e/2)): two normal factors where 2^e itself would
    leave the type's normal range (a subnormal scale may be flushed to 0)."""
    e = e.astype(jnp.int32)
    half = e // 2
    return _exact_pow2(half, dtype), _exact_pow2(e - half, dtype)


def _exact_pow2(k, dtype):
    """2^k for k in the normal range of `dtype`, built from its bits."""
    info = jnp.finfo(dtype)
    bits = jnp.int64 if info.bits == 64 else jnp.int32
    biased = (k.astype(bits) - info.minexp + 1) << info.nmant
    return lax.bitcast_convert_type(biased, dtype)


def _clamp(v, wire):
    """To +-M, so rounding can never overflow; inf and NaN pass."""
    hi = float(jnp.finfo(wire).max)
    return jnp.where(jnp.isinf(v), v, jnp.clip(v, -hi, hi))


def encode(v, e, wire):
    """round(v * 2^e) in `wire`, with v in the accumulator type; `e` broadcasts."""
    lo, hi = _pow2(e, v.dtype)
    return _clamp(v * lo * hi, wire).astype(wire)


def decode(w, e, dtype):
    """w * 2^-e in `dtype`, exact (a power of two), except that a finite w
    which rounded up past the type's largest value decodes to that value,
    not inf (the input it came from was finite)."""
    lo, hi = _pow2(-e.astype(jnp.int32), dtype)
    v = w.astype(dtype)
    top = float(jnp.finfo(dtype).max)
    return jnp.where(jnp.isfinite(v), jnp.clip(v * lo * hi, -top, top), v)


def cast_error(v, wire):
    """What a device's own cast drops from one part v: v - decode(encode(v)),
    computed as :func:`allreduce` casts it."""
    acc = _accumulator(v.dtype)
    a = v.astype(acc)
    e = exponent(a, wire)
    return (a - decode(encode(a, e, wire), e, acc)).astype(v.dtype)


def _bytes(w):
    return lax.bitcast_convert_type(w, jnp.uint8)


def _exponent_bytes(e):
    """(..., P) int16 -> (..., 2P) uint8."""
    b = lax.bitcast_convert_type(e, jnp.uint8)
    return b.reshape(*e.shape[:-1], -1)


def _exponents(b, parts: int):
    """(..., 2P) uint8 -> (..., P) int16."""
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], parts, 2), _EXPONENT)


def _part_exponents(flat, sizes, wire):
    """(P,) exponents, one per part of `flat` (static sizes)."""
    offsets = np.cumsum((0, *sizes))
    return jnp.stack([exponent(flat[offsets[k] : offsets[k + 1]], wire) for k in range(len(sizes))])


def _per_element(values, sizes, total: int):
    """(..., P) -> (..., total): each part's value over its elements (and the
    last part's over the padding)."""
    pieces = [
        jnp.broadcast_to(values[..., k : k + 1], (*values.shape[:-1], s))
        for k, s in enumerate(sizes)
    ]
    pad = total - sum(sizes)
    if pad:
        pieces.append(jnp.broadcast_to(values[..., -1:], (*values.shape[:-1], pad)))
    return jnp.concatenate(pieces, axis=-1) if len(pieces) > 1 else pieces[0]


def _sum_rows(terms):
    """The rows added in rank order, one elementwise add each, which XLA
    fuses into one pass: its CPU reduce over the leading axis took 5-8x as
    long (4 MiB a device, 8 devices)."""
    total = terms[0]
    for i in range(1, terms.shape[0]):
        total = total + terms[i]
    return total


def _add_rows(terms, factor: float):
    """factor * the sum of the rows of `terms`. For a mean (factor 1/N) of
    finite values the result is finite: the rows are scaled by 2^-k first,
    2^k >= N (exact), so their sum cannot overflow, and the rest of 1/N,
    2^k/N, can only round a mean of values near the type's largest past it,
    which is clamped back."""
    if factor == 1.0:
        return _sum_rows(terms)
    power = float(1 << (terms.shape[0] - 1).bit_length())
    total = _sum_rows(terms * (1.0 / power))
    top = float(jnp.finfo(terms.dtype).max)
    scaled = total * (factor * power)
    return jnp.where(jnp.isfinite(total), jnp.clip(scaled, -top, top), scaled)


def allreduce(x, place: AxisPlacement, wire, prescale, postscale, parts=None):
    """The schedule in this module's docstring. `x` is flat; `parts` are the
    static sizes of its parts (one scale each), the whole of `x` if None;
    prescale * postscale is 1/N for a mean, 1 for a sum."""
    n, size, r = x.size, place.size, place.rank
    sizes = tuple(parts) if parts is not None else (n,)
    acc_t = _accumulator(x.dtype)
    row = -(-n // size)
    a = x.astype(acc_t)
    e = _part_exponents(a, sizes, wire)  # (P,)
    padded = jnp.pad(a, (0, row * size - n)) if row * size != n else a
    if len(sizes) == 1:
        w = encode(padded, e[0], wire)
    else:
        w = encode(padded, _per_element(e, sizes, row * size), wire)
    header = jnp.broadcast_to(_exponent_bytes(e), (size, 2 * len(sizes)))
    rows = jnp.concatenate([_bytes(w).reshape(size, row), header], axis=1)
    got = lax.all_to_all(rows, place.axes, 0, 0, tiled=True)  # got[i]: row r of device i
    senders = _exponents(got[:, row:], len(sizes))  # (N, P)
    if len(sizes) == 1:
        scale = senders
    else:
        # Which part each element of row r belongs to.
        ends = jnp.asarray(np.cumsum(sizes), jnp.int32)
        index = r * row + jnp.arange(row, dtype=jnp.int32)
        part = jnp.minimum(jnp.searchsorted(ends, index, side="right"), len(sizes) - 1)
        scale = senders[:, part]
    values = lax.bitcast_convert_type(got[:, :row], wire)
    reduced = _add_rows(decode(values, scale, acc_t), prescale * postscale)
    mine_e = exponent(reduced, wire)
    mine = jnp.concatenate([_bytes(encode(reduced, mine_e, wire)), _exponent_bytes(mine_e[None])])
    to = "invarying" if is_vma_typed(mine, place.axes) else "varying"
    gathered = lax.all_gather(mine, place.axes, tiled=True, to=to).reshape(size, row + 2)
    every = _exponents(gathered[:, row:], 1)  # (N, 1)
    values = lax.bitcast_convert_type(gathered[:, :row], wire)
    return decode(values, every, acc_t).reshape(-1)[:n].astype(x.dtype)
