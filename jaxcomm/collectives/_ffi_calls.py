"""Thin ``jax.ffi.ffi_call`` wrappers, one per handler of xla_ffi/.

Each builds the call's result type and attributes and nothing else: which
handler runs where, how a call finds its peers (`peers`, `coords`: see
_peers.py) and whether it may take its input's buffer are the backends'
decisions (backends/). The attribute names and codes are the handlers'
(xla_ffi/common/ffi_bindings.h; the codes from _extension.codes()); the
lists several handlers share are written once here as they are there
(xla_ffi/common/attr_lists.h), and tests/test_ffi_codes.py checks they agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.collectives import _extension
from jaxcomm.collectives._axes import AxisPlacement, reduced_type
from jaxcomm.collectives.varying import varying_axes


def _result(x, shape, axes, dtype=None):
    """Result type: like x (of `dtype` where given), but replicated over
    `axes` (inside shard_map the manual-axis type says so, and it needs the
    mesh from x's sharding)."""
    dtype = x.dtype if dtype is None else dtype
    mat = reduced_type(x, axes)
    if mat is None or mat.empty:
        return jax.ShapeDtypeStruct(shape, dtype)
    mesh = jax.typeof(x).sharding.mesh
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * len(shape)))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=mat)


def _reduction_attributes(x, place, peers, algorithm, wire, prescale, postscale) -> dict:
    """The attributes jaxcomm_allreduce, jaxcomm_allreduce_parts and
    jaxcomm_allreduce_start share: the peers, the schedule and the wire (x:
    the input, or its first part)."""
    return {
        **peers,
        "algorithm": _extension.algorithm_code(algorithm),
        "nranks": np.int32(place.size),
        "intra_size": np.int32(place.shape[-1] if len(place.axes) == 2 else 1),
        "wire_dtype": _extension.wire_code(wire, x.dtype),
        "prescale": np.float64(prescale),
        "postscale": np.float64(postscale),
    }


def _chunk_mask_attributes(chunk_size, max_chunks, zero_unselected) -> dict:
    """jaxcomm_allreduce's chunk mask attributes: the chunks' size, how many
    selected chunks are reduced (None: all) and what the others hold."""
    return {
        "chunk_size": np.int64(chunk_size),
        "max_chunks": np.int64(max_chunks or 0),
        "unselected": _extension.unselected_code("zero" if zero_unselected else "local"),
    }


def allreduce(
    x,
    coords,
    peers: dict,
    place: AxisPlacement,
    *,
    algorithm: str,
    wire,
    prescale: float,
    postscale: float,
    chunk_mask=None,
    chunk_size: int = 1,
    max_chunks=None,
    zero_unselected: bool = False,
    aliased: bool = False,
):
    """Flat 1-D allreduce in one custom call (mask: pack, reduce, unpack inside).

    With a mask, `zero_unselected` makes the call zero the unselected chunks,
    so that the result is the same on every device and typed replicated;
    otherwise they keep local values. `max_chunks`: the first that many
    selected chunks are reduced (None: all). `aliased`: the result takes x's
    buffer.
    """
    _extension.require()
    mask = jnp.zeros((0,), jnp.bool_) if chunk_mask is None else chunk_mask
    replicated = chunk_mask is None or zero_unselected
    call = jax.ffi.ffi_call(
        "jaxcomm_allreduce",
        _result(x, x.shape, place.axes if replicated else ()),
        input_output_aliases={0: 0} if aliased else None,
    )
    return call(
        x,
        coords,
        mask,
        **_reduction_attributes(x, place, peers, algorithm, wire, prescale, postscale),
        **_chunk_mask_attributes(chunk_size, max_chunks, zero_unselected),
    )


def allreduce_parts(
    parts, coords, peers: dict, place: AxisPlacement, *, algorithm, wire, prescale, postscale
):
    """One allreduce over several arrays of one dtype (a bucket of leaves),
    as if they lay one after another; returns one result per part, shaped
    like it and typed replicated. No concatenate before the call and no
    slices after it: the direct schedule reads and writes the parts where
    they are; the others copy them together inside the handler."""
    _extension.require("cpu")
    results = tuple(_result(p, p.shape, place.axes) for p in parts)
    call = jax.ffi.ffi_call("jaxcomm_allreduce_parts", results)
    return call(
        coords,
        *parts,
        **_reduction_attributes(parts[0], place, peers, algorithm, wire, prescale, postscale),
    )


def allreduce_start(
    x,
    coords,
    peers: dict,
    place: AxisPlacement,
    *,
    algorithm,
    wire,
    prescale,
    postscale,
    nonce,
    chunk_mask=None,
    chunk_size: int = 1,
):
    """Starts the allreduce of flat `x` and returns at once: int32[3], the
    handle that :func:`allreduce_done` takes in a later execution, [`nonce`,
    op id, sequence]. The handle is the same on every device
    (xla_ffi/cpu/allreduce_async.cc), so it is typed replicated over every
    axis, even those x varies over beside `place`'s. With `chunk_mask` only
    the selected chunks travel, and the done call's result is zero on the
    others (as :func:`allreduce`'s with ``zero_unselected``)."""
    _extension.require("cpu")
    mask = jnp.zeros((0,), jnp.bool_) if chunk_mask is None else chunk_mask
    every = varying_axes(x)
    call = jax.ffi.ffi_call(
        "jaxcomm_allreduce_start",
        _result(x, (3,), every or place.axes, jnp.int32),
        has_side_effect=True,
    )
    return call(
        x,
        coords,
        mask,
        **_reduction_attributes(x, place, peers, algorithm, wire, prescale, postscale),
        nonce=np.int32(nonce),
        chunk_size=np.int64(chunk_size),
    )


def allreduce_done(handle, shape, dtype, *, nonce, missing_ok: bool = False):
    """(the result of the allreduce that returned `handle`, int32 found): the
    result of `shape` and `dtype` as the started input, typed as the handle
    is (replicated: where the input varied over other axes too, the caller
    types the result back). A handle this job (`nonce`) has not in flight is
    an error, or with `missing_ok` found = 0 and the result unwritten."""
    _extension.require("cpu")
    call = jax.ffi.ffi_call(
        "jaxcomm_allreduce_done",
        (_result(handle, shape, (), dtype), _result(handle, (), (), jnp.int32)),
        has_side_effect=True,
    )
    return call(handle, nonce=np.int32(nonce), missing_ok=bool(missing_ok))


def reduce_scatter(x, coords, peers: dict, place: AxisPlacement, *, wire, prescale, postscale):
    _extension.require()
    shard = -(-x.size // place.size)
    call = jax.ffi.ffi_call("jaxcomm_reduce_scatter", _result(x, (shard,), ()))
    return call(
        x,
        coords,
        **peers,
        nranks=np.int32(place.size),
        wire_dtype=_extension.wire_code(wire, x.dtype),
        prescale=np.float64(prescale),
        postscale=np.float64(postscale),
    )


def all_gather(x, coords, peers: dict, place: AxisPlacement, *, wire):
    _extension.require()
    call = jax.ffi.ffi_call("jaxcomm_all_gather", _result(x, (place.size, x.size), place.axes))
    return call(
        x,
        coords,
        **peers,
        nranks=np.int32(place.size),
        wire_dtype=_extension.wire_code(wire, x.dtype),
    )


def after(x, deps):
    """`x`, once every array in `deps` exists: the call reads nothing of
    `deps` and returns x in x's own buffer, with x's type, so that XLA
    schedules x's readers after the producers of `deps` (CPU)."""
    _extension.require("cpu")
    call = jax.ffi.ffi_call("jaxcomm_after", _result(x, x.shape, ()), input_output_aliases={0: 0})
    return call(x, *deps)


def pool(parts, addend=None, *, like=None):
    """The flat `parts` one after another, plus `addend` (CPU): one pass at
    memory speed, where XLA's CPU code for a concatenate or a buffer updated
    part by part runs several times slower. The parts have one float dtype
    and fill the result exactly. Without an addend they are copied as they
    are, and the result is typed as `like` (an array of the parts' dtype and
    type, any shape)."""
    _extension.require("cpu")
    if addend is None:
        size = sum(int(p.size) for p in parts)
        call = jax.ffi.ffi_call("jaxcomm_pool", _result(like, (size,), ()))
        return call(jnp.zeros((0,), like.dtype), *parts)
    call = jax.ffi.ffi_call("jaxcomm_pool", _result(addend, addend.shape, ()))
    return call(addend, *parts)


def chunk_l1(local, exchanged, mask, *, chunk_size: int):
    """The float32 L1 norm of every chunk (CPU): from `exchanged` where `mask`
    selects the chunk, from `local` elsewhere; reads each element once."""
    _extension.require("cpu")
    call = jax.ffi.ffi_call("jaxcomm_chunk_l1", _result(local, mask.shape, (), jnp.float32))
    return call(local, exchanged, mask, chunk_size=np.int64(chunk_size))


def chunk_residual(local, mask, skip, old, *, chunk_size: int, decay: float):
    """`decay * local` on the chunks `mask` leaves out, zeros on the others;
    `old` as it is where `skip` (CPU); shaped like `old`. Reads only the
    unselected chunks, and writes into `old`'s buffer."""
    _extension.require("cpu")
    call = jax.ffi.ffi_call(
        "jaxcomm_chunk_residual", _result(local, old.shape, ()), input_output_aliases={3: 0}
    )
    return call(local, mask, skip, old, chunk_size=np.int64(chunk_size), decay=np.float64(decay))
