"""Integer wires (int8, int4): a float32 scale per chunk of 256 elements, a
reduce-scatter by all-to-all and an all-gather, every addition in float32.

The exchange is the FP8 wire's (_fp8.py); what differs is the code:

1. Each device cuts each part of its input (a leaf of a bucket, or the whole
   input) into chunks of :data:`CHUNK` elements from the part's start (the
   last one shorter), takes s = A_c / Q per chunk, A_c its largest |x| and
   Q = 127 for int8, 7 for int4, and sends round(x / s) (to nearest, ties
   to even) in [-Q, Q]: int8 as bytes, int4 two to a byte.
2. An all-to-all sends row j of the codes (n/N elements, padded), with the
   scales of every chunk that row touches, to device j, which decodes the N
   rows in float32 (float64 for float64 input), adds them in rank order and
   applies 1/N for a mean (_fp8._add_rows).
3. Device j encodes its reduced row the same way (chunks from the row's
   start) and an all-gather gives every device every row and its scales,
   which every device decodes the same way.

The scales are local and what a device's encoding drops is known to it alone
(:func:`cast_error`, for error feedback). A chunk of 256 keeps an outlier's
reach to 256 elements (a row of a typical weight matrix or less) while the
scales cost 4/256 byte an element: 1.6% on int8, 3.1% on int4.

Error bound. Let A be the largest |x| over all devices within 2(CHUNK - 1)
= 510 elements of an element (the chunks of either encoding that decide its
error lie there; at most the largest |x| of the input, and of a leaf where
each leaf is its own collective). Rounding to nearest errs by at most half
a step, s/2 = A_c / (2Q), so each decoded input is within A / (2Q) of x_i
and their mean within A / (2Q) of the true mean. A code is at most Q, so a
decoded value is at most A_c and so is the reduced mean, whose encoding adds
at most A / (2Q). So, per element, for a mean

    |y - mean(x)| <= A / Q,

one step of the code, independent of N (0.00787 A for int8, 0.143 A for
int4), N times that for a sum, up to float32's own rounding (relative 2^-24
per operation) and as long as A / Q is a normal float32 (A above 2^-119).

An integer has no code for inf or NaN: a chunk that holds one is sent with a
NaN scale and decodes to NaN, so the result is NaN, on every device, at every
element that shares a chunk (of either encoding) with a non-finite input:
never a finite value that hides it. A sum that overflows float32 does the
same to its chunk of the reduced row.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.collectives import _fp8
from jaxcomm.collectives._axes import AxisPlacement, is_vma_typed

CHUNK = 256  # elements per scale
WIRES = (np.dtype(jnp.int8), np.dtype(jnp.int4))
_LEVELS = {np.dtype(jnp.int8): 127, np.dtype(jnp.int4): 7}


def levels(wire) -> int:
    """Q: codes are the integers in [-Q, Q] (symmetric, so 0 is exact)."""
    return _LEVELS[np.dtype(wire)]


def _per_byte(wire) -> int:
    """Codes per byte on the wire: 1 for int8, 2 for int4."""
    return 2 if np.dtype(wire) == np.dtype(jnp.int4) else 1


def _chunks(elements: int) -> int:
    return -(-elements // CHUNK)


def _row(elements: int, size: int, wire) -> int:
    """Elements of a row: n/N rounded up, even for int4 (whole bytes)."""
    k = _per_byte(wire)
    return -(-elements // (size * k)) * k


def _chunk_of(g, sizes, elements: int):
    """The chunk (counted over all parts) of flat index `g` (NumPy or jnp);
    the padding past `elements` belongs to the last chunk."""
    xp = np if isinstance(g, np.ndarray | int | np.integer) else jnp
    ends = np.cumsum(sizes)
    starts = np.concatenate([[0], ends[:-1]])
    first = np.concatenate([[0], np.cumsum([_chunks(s) for s in sizes])[:-1]])
    g = xp.minimum(g, elements - 1)
    part = xp.minimum(xp.searchsorted(ends, g, side="right"), len(sizes) - 1)
    if xp is jnp:
        return (
            jnp.asarray(first, jnp.int32)[part]
            + (g - jnp.asarray(starts, jnp.int32)[part]) // CHUNK
        )
    return first[part] + (g - starts[part]) // CHUNK


def header_chunks(elements: int, parts: int, size: int, wire) -> int:
    """K: scales each all-to-all row carries. For one part, the most chunks
    any row touches; for several (whose sizes the byte count does not know),
    the bound ceil(row / CHUNK) + parts: only a row's first part can start
    mid-chunk, and each part that starts within it adds at most one chunk."""
    row = _row(elements, size, wire)
    if parts > 1:
        return _chunks(row) + parts
    r = np.arange(size)
    return int(
        np.max(
            _chunk_of((r + 1) * row - 1, (elements,), elements)
            - _chunk_of(r * row, (elements,), elements)
        )
        + 1
    )


def exchange_bytes(elements: int, parts: int, size: int, wire, scale_itemsize: int = 4) -> tuple:
    """(all-to-all, all-gather) bytes of one allreduce of `elements` in
    `parts` parts over `size` devices: the size of each collective's result,
    N rows of codes and scales, of which a device sends N-1 rows."""
    row = _row(elements, size, wire)
    codes = row // _per_byte(wire)
    to_all = size * (codes + header_chunks(elements, parts, size, wire) * scale_itemsize)
    gathered = size * (codes + _chunks(row) * scale_itemsize)
    return to_all, gathered


def payload_bytes(elements: int, parts: int, size: int, wire, scale_itemsize: int = 4) -> int:
    """What a device puts into the allreduce, counted as payload is
    (bytes_sent = 2(N-1)/N x payload is what it sends to its peers)."""
    if elements == 0:
        return 0
    return sum(exchange_bytes(elements, parts, size, wire, scale_itemsize)) // 2


def _scales(a, wire):
    """(ceil(n/CHUNK),) scales of flat `a` (accumulator type): max|x| / Q per
    chunk; NaN for a chunk holding an inf or NaN (max propagates them)."""
    n = a.size
    padded = jnp.pad(a, (0, _chunks(n) * CHUNK - n)).reshape(-1, CHUNK)
    top = jnp.max(jnp.abs(padded), axis=1)
    return jnp.where(jnp.isfinite(top), top / levels(wire), jnp.nan)


def _encode(a, s, wire):
    """int8 codes round(a / s) in [-Q, Q], `s` broadcast over `a`; 0 where
    s is 0 (a chunk of zeros) or NaN (its decoding is NaN all the same)."""
    ok = s > 0
    q = levels(wire)
    c = jnp.round(a / jnp.where(ok, s, 1))
    return jnp.where(ok, jnp.clip(c, -q, q), 0).astype(jnp.int8)


def _decode(c, s, dtype):
    """c * s in `dtype`, clamped to the type's finite range (a code of Q
    times a scale rounded up may pass the largest value); NaN stays."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(c.astype(dtype) * s, -top, top)


def _chunked(values, m: int):
    """(..., m) -> (..., ceil(m/CHUNK), CHUNK), zero-padded."""
    pad = _chunks(m) * CHUNK - m
    widths = [(0, 0)] * (values.ndim - 1) + [(0, pad)]
    return jnp.pad(values, widths).reshape(*values.shape[:-1], -1, CHUNK)


def _encode_part(a, wire):
    """(codes (n,), scales (ceil(n/CHUNK),)) of flat `a`, chunks from its start."""
    s = _scales(a, wire)
    return _encode(_chunked(a, a.size), s[:, None], wire).reshape(-1)[: a.size], s


def _decode_rows(codes, s, dtype):
    """codes (..., m), scales (..., ceil(m/CHUNK)) -> values (..., m)."""
    m = codes.shape[-1]
    v = _decode(_chunked(codes, m), s[..., None], dtype)
    return v.reshape(*codes.shape[:-1], -1)[..., :m]


def cast_error(v, wire):
    """What a device's own encoding drops from one part v:
    v - decode(encode(v)), computed as :func:`allreduce` encodes it."""
    acc = _fp8._accumulator(v.dtype)
    a = v.astype(acc).reshape(-1)
    codes, s = _encode_part(a, wire)
    return (a - _decode_rows(codes, s, acc)).astype(v.dtype).reshape(v.shape)


def _pack(codes, wire):
    """int8 codes (..., m) -> the bytes that travel: (..., m), or (..., m/2)
    for int4 (low nibble the even element, two's complement)."""
    b = lax.bitcast_convert_type(codes, jnp.uint8)
    if _per_byte(wire) == 1:
        return b
    pairs = b.reshape(*b.shape[:-1], -1, 2)
    return (pairs[..., 0] & 0xF) | (pairs[..., 1] << 4)


def _unpack(b, wire):
    """The inverse of :func:`_pack`: uint8 (..., bytes) -> int8 codes."""
    s = lax.bitcast_convert_type(b, jnp.int8)
    if _per_byte(wire) == 1:
        return s
    low = lax.shift_right_arithmetic(lax.shift_left(s, jnp.int8(4)), jnp.int8(4))
    high = lax.shift_right_arithmetic(s, jnp.int8(4))
    return jnp.stack([low, high], axis=-1).reshape(*b.shape[:-1], -1)


def _scale_bytes(s):
    """(..., K) floats -> (..., K * itemsize) uint8."""
    b = lax.bitcast_convert_type(s, jnp.uint8)
    return b.reshape(*s.shape[:-1], -1)


def _scales_of(b, dtype):
    """(..., K * itemsize) uint8 -> (..., K) `dtype`."""
    k = np.dtype(dtype).itemsize
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, k), dtype)


def allreduce(x, place: AxisPlacement, wire, prescale, postscale, parts=None):
    """The schedule in this module's docstring. `x` is flat; `parts` are the
    static sizes of its parts (chunks never span two), the whole of `x` if
    None; prescale * postscale is 1/N for a mean, 1 for a sum."""
    n, size, r = x.size, place.size, place.rank
    if n == 0:
        return x
    sizes = tuple(int(s) for s in parts) if parts is not None else (n,)
    acc_t = _fp8._accumulator(x.dtype)
    row = _row(n, size, wire)
    width = row // _per_byte(wire)
    a = x.astype(acc_t)
    offsets = np.cumsum((0, *sizes))
    encoded = [_encode_part(a[offsets[k] : offsets[k + 1]], wire) for k in range(len(sizes))]
    codes = jnp.concatenate([c for c, _ in encoded]) if len(sizes) > 1 else encoded[0][0]
    scales = jnp.concatenate([s for _, s in encoded]) if len(sizes) > 1 else encoded[0][1]
    codes = jnp.pad(codes, (0, row * size - n))

    # Row j carries the scales of the K chunks from the first one it touches.
    k = header_chunks(n, len(sizes), size, wire)
    first = _chunk_of(np.arange(size) * row, sizes, n)
    last = _chunk_of((np.arange(size) + 1) * row - 1, sizes, n)
    assert int(np.max(last - first)) < k, (sizes, size)
    index = np.minimum(first[:, None] + np.arange(k), scales.size - 1)
    header = _scale_bytes(scales[index])  # (N, K * itemsize)
    rows = jnp.concatenate([_pack(codes.reshape(size, row), wire), header], axis=1)
    got = lax.all_to_all(rows, place.axes, 0, 0, tiled=True)  # got[i]: row r of device i
    senders = _scales_of(got[:, width:], acc_t)  # (N, K)
    g = r * row + jnp.arange(row, dtype=jnp.int32)
    slot = _chunk_of(g, sizes, n) - jnp.asarray(first, jnp.int32)[r]
    values = _decode(_unpack(got[:, :width], wire), senders[:, slot], acc_t)
    reduced = _fp8._add_rows(values, prescale * postscale)

    mine_codes, mine_s = _encode_part(reduced, wire)
    mine = jnp.concatenate([_pack(mine_codes, wire), _scale_bytes(mine_s)])
    to = "invarying" if is_vma_typed(mine, place.axes) else "varying"
    gathered = lax.all_gather(mine, place.axes, tiled=True, to=to).reshape(size, -1)
    every = _scales_of(gathered[:, width:], acc_t)  # (N, ceil(row/CHUNK))
    out = _decode_rows(_unpack(gathered[:, :width], wire), every, acc_t)
    return out.reshape(-1)[:n].astype(x.dtype)
