"""The ffi backend on GPU: jaxcomm's CUDA handlers over NCCL (xla_ffi/cuda/)."""

from __future__ import annotations

import jax

from jaxcomm.collectives import _extension, _peers
from jaxcomm.collectives.backends.ffi import FfiBackend


class CudaFfiBackend(FfiBackend):
    """The CUDA handlers. A masked allreduce's mask stays on the device and
    NCCL takes its sizes from the host, so the handler packs into a buffer
    of a fixed size, ``max_chunks`` chunks (all without a bound), rather than
    wait for the device to count them.

    ``algorithm="auto"`` is ``"direct"``, which the handler runs as the
    fastest schedule that adds in float32: ``ncclAllReduce`` where NCCL adds
    in the input's dtype (float32 or float64, no wire cast: the call
    ``lax.psum`` makes, pipelined inside NCCL), and ``"alltoall"`` where NCCL
    would add in 16 bits (a 16-bit wire or input): one grouped all-to-all of
    wire-typed shards, a float32 add, one ``ncclAllGather``; the ring's bytes
    in two NCCL launches instead of 2(N-1) host-polled steps (docs/cuda.md).
    ``"ring"`` and ``"hierarchical"`` stay selectable by name."""

    sends_only_selected = False

    def peers(self, x, place) -> dict:
        # On XLA's own communicators, the device groups pick the one to use.
        cuda = _extension.cuda_module()
        if cuda is not None and bool(getattr(cuda, "uses_xla_communicators", False)):
            return {"groups": _peers.device_groups(x, place).ravel()}
        op_id = _peers.next_op_id()
        if jax.process_count() > 1:
            _peers.share_nccl_ids(int(op_id), jax.device_count() // place.size)
        return {"op_id": op_id}

    def coords(self, place):
        return _peers.coords(place)
