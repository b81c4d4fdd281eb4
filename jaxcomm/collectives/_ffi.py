"""The `ffi` backend: XLA FFI custom calls into xla_ffi/.

Each call carries an int32 [group, rank] operand from `lax.axis_index`, and
what its handler needs to find its peers: on CPU, and on GPU with a jaxlib
older than 0.11, an op id, unique per call site and equal on every device
(all devices run the same program; in one process the handler adds the
execution's RunId, across processes on CPU it reaches every rank over TCP
at the address published for it at trace time, and takes its own
[group, rank] from what the trace registered for its device);
on GPU with a jaxlib that lends handlers XLA's own communicators, the
call's device groups, from which XLA picks the NCCL communicator.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.collectives._axes import AxisPlacement, bound_axes, reduced_type

# Integer codes shared with xla_ffi/common/dtype.h and xla_ffi/cpu/collective.h.
_DTYPE_CODES = {
    np.dtype(jnp.float32): 0,
    np.dtype(jnp.float16): 1,
    np.dtype(jnp.bfloat16): 2,
    np.dtype(jnp.float64): 3,
}
ALGORITHM_CODES = {"ring": 0, "hierarchical": 1, "direct": 2}
# What a masked allreduce leaves in the chunks it does not reduce (the
# handlers' kUnselectedLocal and kUnselectedZero).
_UNSELECTED_LOCAL, _UNSELECTED_ZERO = 0, 1

_op_ids = itertools.count(1)


@functools.cache
def _extension():
    """The compiled module, or None when jaxcomm was installed without it."""
    try:
        from jaxcomm import _ffi
    except ImportError:
        return None
    return _ffi


@functools.cache
def cuda_module():
    """The CUDA/NCCL module if it was built, else None. Importing it starts
    no JAX backend (and no CUDA context), unlike asking JAX for GPUs."""
    try:
        from jaxcomm import _ffi_cuda
    except ImportError:
        return None
    return _ffi_cuda


@functools.cache
def _cuda_extension():
    """The CUDA/NCCL module, or None: not built, or no GPU to run it on."""
    try:
        if not jax.devices("gpu"):
            return None
    except RuntimeError:  # no GPU backend in this jax
        return None
    return cuda_module()


@functools.cache
def _register() -> frozenset:
    """Registers the handlers with XLA once; returns the platforms served."""
    platforms = set()
    ext = _extension()
    if ext is not None:
        for name, capsule in ext.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        platforms.add("cpu")
    cuda = _cuda_extension()
    if cuda is not None:
        for name, capsule in cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        platforms.add("gpu")
    return frozenset(platforms)


def _on_xla_communicators() -> bool:
    """Whether this trace's collectives run on XLA's own NCCL communicators
    (GPU, with the CUDA module built against a jaxlib that lends them)."""
    cuda = cuda_module()
    return (
        jax.default_backend() == "gpu"
        and cuda is not None
        and bool(getattr(cuda, "uses_xla_communicators", False))
    )


def device_groups(x, place: AxisPlacement) -> np.ndarray:
    """The device groups of ``place.axes``, one row per group in rank order,
    as XLA numbers a program's devices: flattened ids, row-major over the
    mesh axes (what JAX's own collectives inside shard_map use), or over the
    bound axes under pmap, where the ids are replica ids."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
        names, sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    else:
        bound = bound_axes()
        names, sizes = tuple(bound), tuple(bound.values())
    ids = np.arange(math.prod(sizes), dtype=np.int64).reshape(sizes)
    reduced = [names.index(a) for a in place.axes]
    last = list(range(len(names) - len(reduced), len(names)))
    return np.moveaxis(ids, reduced, last).reshape(-1, place.size)


def _peers(x, place: AxisPlacement) -> dict:
    """The attribute by which a handler finds its peers: the device groups on
    XLA's communicators, else a fresh call-site id."""
    if _on_xla_communicators():
        return {"groups": device_groups(x, place).ravel()}
    return {"op_id": _op_id(x, place)}


def _op_id(x, place: AxisPlacement) -> np.int64:
    """A fresh call-site id. With several processes, also shares what the
    handlers need to reach the other processes through the jax.distributed
    key-value store, before the first call needs it: one NCCL unique id per
    group on GPU, every device-rank's TCP address on CPU. Every process
    traces the same program, so the counters agree across processes."""
    op_id = next(_op_ids)
    if jax.process_count() > 1:
        if jax.default_backend() == "gpu" and available("gpu"):
            _share_nccl_ids(op_id, jax.device_count() // place.size)
        elif jax.default_backend() == "cpu":
            _share_tcp_addresses(op_id, x, place)
    return np.int64(op_id)


def _program_devices() -> list:
    """The devices as :func:`device_groups` numbers them. Under ``jit`` the
    trace sees only the abstract mesh; its devices are known when set with
    ``jax.set_mesh``, else taken in ``jax.devices()`` order, the order of
    ``jax.make_mesh`` and ``jaxcomm.distributed.hierarchical_mesh`` on CPU.
    A rank that runs elsewhere fails with a clear error (no address was
    published for it there)."""
    from jax._src.mesh import get_concrete_mesh  # no public API while tracing

    mesh = get_concrete_mesh()
    return jax.devices() if mesh is None or mesh.empty else list(mesh.devices.flat)


def _share_tcp_addresses(op_id: int, x, place: AxisPlacement) -> None:
    """Every device-rank of call site ``op_id`` in this process listens on a
    socket of its own, on the address this job's collectives use (gloo's,
    never every interface), and publishes it; every process registers all
    ranks' addresses of the groups it takes part in with the handler. Ranks
    of one process reach each other over TCP too (loopback)."""
    from jax._src.distributed import global_state  # the coordinator jax.distributed uses

    from jaxcomm.distributed.exchange import Exchange
    from jaxcomm.distributed.network import collective_address

    ext = _extension()
    exchange = Exchange.open(f"tcp/{op_id}", max(ext.get_timeout(), 1.0))
    if exchange is None:
        raise RuntimeError(
            "backend='ffi' on several CPU processes needs jax.distributed.initialize"
        )
    host = collective_address(global_state.coordinator_address)
    devices = _program_devices()
    own = {}
    for group, row in enumerate(device_groups(x, place)):
        for rank, device in enumerate(row):
            if devices[device].process_index == exchange.process_id:
                own[f"{group}/{rank}"] = [host, ext.tcp_listen(op_id, group, rank, host)]
                ext.tcp_set_rank(op_id, devices[device].id, group, rank)  # the FFI DeviceOrdinal
    everyone, _ = exchange.gather(
        own, what="the addresses of their ffi collectives", caller="the same program"
    )
    addresses = {key: value for values in everyone.values() for key, value in values.items()}
    for group in sorted({int(key.partition("/")[0]) for key in own}):
        peers = [tuple(addresses[f"{group}/{rank}"]) for rank in range(place.size)]
        ext.tcp_set_peers(op_id, group, peers)


def _share_nccl_ids(op_id: int, ngroups: int, timeout_s: float = 300) -> None:
    """Process 0 makes one NCCL unique id per group of call site ``op_id`` and
    publishes it; every process registers the same ids with the handler."""
    from jaxcomm.distributed.exchange import Exchange

    exchange = Exchange.open(f"nccl/{op_id}", timeout_s)
    if exchange is None:
        raise RuntimeError(
            "backend='ffi' on several GPU processes needs jax.distributed.initialize"
        )
    cuda = _cuda_extension()
    for group in range(ngroups):
        if exchange.process_id == 0:
            raw = cuda.nccl_unique_id()
            exchange.publish(str(group), raw.hex())
        else:
            raw = bytes.fromhex(exchange.read(str(group)))
        cuda.register_unique_id(op_id, group, raw)


def available(platform: str | None = None) -> bool:
    """Whether the ffi backend can run on `platform` (default: jax's default backend)."""
    platform = platform or jax.default_backend()
    return platform in _register()


def require(platform: str | None = None) -> None:
    platform = platform or jax.default_backend()
    if _extension() is None:
        raise RuntimeError(
            "backend='ffi' needs jaxcomm's compiled extension (jaxcomm._ffi), which is not "
            "installed; reinstall jaxcomm from source, or use backend='xla'"
        )
    if not available(platform):
        raise RuntimeError(
            f"backend='ffi' has no handler for platform {platform!r} in this build "
            f"(available: {sorted(_register())}); use backend='xla'"
        )


def packs_exactly() -> bool:
    """Whether a masked allreduce sends exactly the selected chunks. On CPU
    the handler reads the mask in host memory; on GPU the mask stays on the
    device and NCCL takes its sizes from the host, so the handler packs into
    a buffer of a fixed size, `max_chunks` chunks (all without a bound),
    rather than wait for the device to count them."""
    return jax.default_backend() == "cpu"


def _wire_code(wire, dtype) -> np.int32:
    return np.int32(-1 if np.dtype(wire) == np.dtype(dtype) else _DTYPE_CODES[np.dtype(wire)])


def _coords(place: AxisPlacement):
    """The [group, rank] operand. Across processes on CPU a constant [-1, -2]:
    the handler takes them from what the trace registered for its device,
    because XLA's CPU runtime starts a custom call with an operand computed
    in the program only after the independent work beside it, so it could
    not overlap the exchange with compute (bench/README.md, overlap)."""
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        # Two different values: XLA would make [-1, -1] a broadcast, computed.
        return np.array([-1, -2], np.int32)
    return jnp.stack([place.group, place.rank]).astype(jnp.int32)


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


def _reduction_attributes(x, place, algorithm, wire, prescale, postscale, intra_size) -> dict:
    """The attributes jaxcomm_allreduce and jaxcomm_allreduce_parts share:
    the peers, the schedule and the wire (x: the input, or its first part)."""
    return {
        **_peers(x, place),
        "algorithm": np.int32(ALGORITHM_CODES[algorithm]),
        "nranks": np.int32(place.size),
        "intra_size": np.int32(intra_size),
        "wire_dtype": _wire_code(wire, x.dtype),
        "prescale": np.float64(prescale),
        "postscale": np.float64(postscale),
    }


def allreduce(
    x,
    place: AxisPlacement,
    *,
    algorithm,
    wire,
    prescale,
    postscale,
    chunk_mask=None,
    chunk_size=1,
    intra_size=1,
    max_chunks=None,
    replicated=False,
    in_place=False,
):
    """Flat 1-D allreduce in one custom call (mask: pack, reduce, unpack inside).

    With a mask, `replicated=True` makes the call zero the unselected chunks,
    so that the result is the same on every device and typed replicated;
    otherwise they keep local values.
    `max_chunks`: the first that many selected chunks are reduced (None:
    all); see :func:`packs_exactly` for what travels.
    `in_place`: the result takes x's buffer where the handler allows it (CPU
    direct without a mask reads each block of every rank before writing it;
    the ring's peers read a rank's input while it writes).
    """
    require()
    mask = jnp.zeros((0,), jnp.bool_) if chunk_mask is None else chunk_mask
    unselected = _UNSELECTED_ZERO if chunk_mask is not None and replicated else _UNSELECTED_LOCAL
    replicated = place.axes if (chunk_mask is None or replicated) else ()
    aliased = (
        in_place and algorithm == "direct" and chunk_mask is None and jax.default_backend() == "cpu"
    )
    call = jax.ffi.ffi_call(
        "jaxcomm_allreduce",
        _result(x, x.shape, replicated),
        input_output_aliases={0: 0} if aliased else None,
    )
    return call(
        x,
        _coords(place),
        mask,
        **_reduction_attributes(x, place, algorithm, wire, prescale, postscale, intra_size),
        chunk_size=np.int64(chunk_size),
        max_chunks=np.int64(max_chunks or 0),
        unselected=np.int32(unselected),
    )


def allreduce_parts(
    parts, place: AxisPlacement, *, algorithm, wire, prescale, postscale, intra_size
):
    """One allreduce over several arrays of one dtype (a bucket of leaves),
    as if they lay one after another; returns one result per part, shaped
    like it and typed replicated (CPU). No concatenate before the call and no
    slices after it: the direct schedule reads and writes the parts where
    they are; the others copy them together inside the handler."""
    require("cpu")
    results = tuple(_result(p, p.shape, place.axes) for p in parts)
    call = jax.ffi.ffi_call("jaxcomm_allreduce_parts", results)
    return call(
        _coords(place),
        *parts,
        **_reduction_attributes(parts[0], place, algorithm, wire, prescale, postscale, intra_size),
    )


def after(x, deps):
    """`x`, once every array in `deps` exists (CPU): the call reads nothing
    of `deps` and returns x in x's own buffer, with x's type, so that XLA
    schedules x's readers after the producers of `deps`."""
    require("cpu")
    call = jax.ffi.ffi_call("jaxcomm_after", _result(x, x.shape, ()), input_output_aliases={0: 0})
    return call(x, *deps)


def pool(parts, addend=None, *, like=None):
    """The flat `parts` one after another, plus `addend` (CPU): one pass at
    memory speed, where XLA's CPU code for a concatenate or a buffer updated
    part by part runs several times slower (bench/README.md, overhead.py).
    The parts have one float dtype and fill the result exactly. Without an
    addend they are copied as they are, and the result is typed as `like`
    (an array of the parts' dtype and type, any shape)."""
    require("cpu")
    if addend is None:
        size = sum(int(p.size) for p in parts)
        call = jax.ffi.ffi_call("jaxcomm_pool", _result(like, (size,), ()))
        return call(jnp.zeros((0,), like.dtype), *parts)
    call = jax.ffi.ffi_call("jaxcomm_pool", _result(addend, addend.shape, ()))
    return call(addend, *parts)


def chunk_l1(local, exchanged, mask, *, chunk_size: int):
    """The float32 L1 norm of every chunk (CPU): from `exchanged` where `mask`
    selects the chunk, from `local` elsewhere; reads each element once."""
    require("cpu")
    call = jax.ffi.ffi_call("jaxcomm_chunk_l1", _result(local, mask.shape, (), jnp.float32))
    return call(local, exchanged, mask, chunk_size=np.int64(chunk_size))


def chunk_residual(local, mask, skip, old, *, chunk_size: int, decay: float):
    """`decay * local` on the chunks `mask` leaves out, zeros on the others;
    `old` as it is where `skip` (CPU); shaped like `old`. Reads only the
    unselected chunks."""
    require("cpu")
    call = jax.ffi.ffi_call(
        "jaxcomm_chunk_residual", _result(local, old.shape, ()), input_output_aliases={3: 0}
    )
    return call(local, mask, skip, old, chunk_size=np.int64(chunk_size), decay=np.float64(decay))


def reduce_scatter(x, place: AxisPlacement, *, wire, prescale, postscale):
    require()
    shard = -(-x.size // place.size)
    call = jax.ffi.ffi_call("jaxcomm_reduce_scatter", _result(x, (shard,), ()))
    return call(
        x,
        _coords(place),
        **_peers(x, place),
        nranks=np.int32(place.size),
        wire_dtype=_wire_code(wire, x.dtype),
        prescale=np.float64(prescale),
        postscale=np.float64(postscale),
    )


def all_gather(x, place: AxisPlacement, *, wire):
    require()
    call = jax.ffi.ffi_call("jaxcomm_all_gather", _result(x, (place.size, x.size), place.axes))
    return call(
        x,
        _coords(place),
        **_peers(x, place),
        nranks=np.int32(place.size),
        wire_dtype=_wire_code(wire, x.dtype),
    )
