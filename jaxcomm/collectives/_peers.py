"""How an ffi call finds its peers: call-site ids, device groups, and what
the handlers need to reach other processes.

Each call carries an int32 [group, rank] operand and either an op id, unique
per call site and equal on every device (all devices run the same program;
in one process the handler adds the execution's RunId, across processes on
CPU it reaches every rank over TCP at the address published for it at trace
time), or, on GPU with a jaxlib that lends handlers XLA's own communicators,
the call's device groups, from which XLA picks the NCCL communicator.
"""

from __future__ import annotations

import itertools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _jax_compat
from jaxcomm.collectives import _extension
from jaxcomm.collectives._axes import AxisPlacement, bound_axes

_op_ids = itertools.count(1)

# The [group, rank] operand of a call whose handler takes them from what the
# trace registered for its device. Two different values: XLA would make
# [-1, -1] a broadcast, computed.
REGISTERED_COORDS = np.array([-1, -2], np.int32)


def next_op_id() -> np.int64:
    """A fresh call-site id. Every process traces the same program, so the
    counters agree across processes."""
    return np.int64(next(_op_ids))


_nonce: list = []


def job_nonce() -> np.int32:
    """A number drawn once per job: process 0 draws it and every process
    reads it. A started allreduce's handle carries it, so that a handle of
    another job (a state restored from a checkpoint) is told apart from this
    job's, whose call-site ids and sequence numbers restart alike."""
    if not _nonce:
        from jaxcomm.distributed.exchange import Exchange

        value = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        exchange = Exchange.open("nonce", max(_extension.cpu_module().get_timeout(), 1.0))
        if exchange is not None:
            if exchange.process_id == 0:
                exchange.publish("value", value)
            else:
                value = exchange.read("value")
        _nonce.append(np.int32(value))
    return _nonce[0]


def coords(place: AxisPlacement):
    """The [group, rank] operand, computed in the program."""
    return jnp.stack([place.group, place.rank]).astype(jnp.int32)


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


def _program_devices() -> list:
    """The devices as :func:`device_groups` numbers them. Under ``jit`` the
    trace sees only the abstract mesh; its devices are known when set with
    ``jax.set_mesh``, else taken in ``jax.devices()`` order, the order of
    ``jax.make_mesh`` and ``jaxcomm.distributed.hierarchical_mesh`` on CPU.
    A rank that runs elsewhere fails with a clear error (no address was
    published for it there)."""
    mesh = _jax_compat.concrete_mesh()
    return jax.devices() if mesh is None or mesh.empty else list(mesh.devices.flat)


def share_tcp_addresses(op_id: int, x, place: AxisPlacement) -> None:
    """Every device-rank of call site ``op_id`` in this process listens on a
    socket of its own, on the address this job's collectives use (gloo's,
    never every interface), and publishes it; every process registers all
    ranks' addresses of the groups it takes part in with the handler. Ranks
    of one process reach each other over TCP too (loopback)."""
    from jaxcomm.distributed.exchange import Exchange
    from jaxcomm.distributed.network import collective_address

    ext = _extension.cpu_module()
    exchange = Exchange.open(f"tcp/{op_id}", max(ext.get_timeout(), 1.0))
    if exchange is None:
        raise RuntimeError(
            "backend='ffi' on several CPU processes needs jax.distributed.initialize"
        )
    host = collective_address(_jax_compat.distributed_state().coordinator_address)
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


def share_nccl_ids(op_id: int, ngroups: int, timeout_s: float = 300) -> None:
    """Process 0 makes one NCCL unique id per group of call site ``op_id`` and
    publishes it; every process registers the same ids with the handler."""
    from jaxcomm.distributed.exchange import Exchange

    exchange = Exchange.open(f"nccl/{op_id}", timeout_s)
    if exchange is None:
        raise RuntimeError(
            "backend='ffi' on several GPU processes needs jax.distributed.initialize"
        )
    cuda = _extension.cuda_runnable()
    for group in range(ngroups):
        if exchange.process_id == 0:
            raw = cuda.nccl_unique_id()
            exchange.publish(str(group), raw.hex())
        else:
            raw = bytes.fromhex(exchange.read(str(group)))
        cuda.register_unique_id(op_id, group, raw)
