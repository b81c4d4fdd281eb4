"""The ffi backend on CPU: jaxcomm's own transport (threads in one process,
TCP between processes), and the CPU calls that work around XLA's CPU code."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxcomm.collectives import _ffi_calls, _peers
from jaxcomm.collectives._linear import linear_collective
from jaxcomm.collectives.backends.ffi import FfiBackend
from jaxcomm.collectives.varying import to_varying

# Bucket parts below this many elements are computed into buffers of their
# own before XLA's concatenate reads them (see concatenate).
SMALL_PART = 1 << 16


class CpuFfiBackend(FfiBackend):
    """The CPU handlers. The handler reads a chunk mask in host memory, so a
    masked allreduce sends exactly the selected chunks. Beside the
    collectives: a bucket reduced where its leaves lie, a value held until
    others exist, chunk-sparse's pool, norms and residual in one pass each."""

    sends_only_selected = True
    # The all-to-all schedule is the CUDA handlers' (xla_ffi/cuda/alltoall.h).
    algorithms = ("auto", "ring", "hierarchical", "direct")

    def peers(self, x, place) -> dict:
        op_id = _peers.next_op_id()
        if jax.process_count() > 1:
            # Every rank's TCP address, shared before the first call needs it.
            _peers.share_tcp_addresses(int(op_id), x, place)
        return {"op_id": op_id}

    def coords(self, place):
        if jax.process_count() > 1:
            # XLA's CPU runtime starts a custom call with an operand computed
            # in the program only after the independent work beside it, so it
            # could not overlap the exchange with compute; the handler takes
            # [group, rank] from what the trace registered for its device.
            return _peers.REGISTERED_COORDS
        return _peers.coords(place)

    def aliases_input(self, algorithm: str) -> bool:
        # Direct reads each block of every rank before writing it; the ring's
        # peers read a rank's input while it writes.
        return algorithm == "direct"

    # jaxcomm's own transport runs on its own threads, independent of XLA's
    # executions (xla_ffi/cpu/allreduce_async.cc).
    starts_async = True

    def allreduce_start(self, bound, flat, *, chunk_mask=None):
        wire, prescale, postscale = bound.scales(flat.dtype)
        return _ffi_calls.allreduce_start(
            flat,
            *self._reach(bound, flat),
            algorithm=bound.algorithm,
            wire=wire,
            prescale=prescale,
            postscale=postscale,
            nonce=_peers.job_nonce(),
            chunk_mask=chunk_mask,
            chunk_size=bound.layout(flat.size).chunk_size,
        )

    def allreduce_done(self, bound, handle, like, *, missing_ok=False):
        del bound
        return _ffi_calls.allreduce_done(
            handle, like.shape, like.dtype, nonce=_peers.job_nonce(), missing_ok=missing_ok
        )

    def allreduce_bucket(self, bound, parts, *, in_place, after):
        if len(parts) < 2:
            return super().allreduce_bucket(bound, parts, in_place=in_place, after=after)
        reduced = self._allreduce_parts(bound, tuple(jnp.asarray(p) for p in parts))
        return [self.after(r, after) if after else r for r in reduced]

    def _allreduce_parts(self, bound, parts):
        """One call over several parts where they lie, into one result each:
        no concatenate before it and no slices after it."""
        place = bound.place
        wire, prescale, postscale = bound.scales(parts[0].dtype)

        def forward(v):
            return _ffi_calls.allreduce_parts(
                v,
                self.coords(place),
                self.peers(v[0], place),
                place,
                algorithm=bound.algorithm,
                wire=wire,
                prescale=prescale,
                postscale=postscale,
            )

        return list(linear_collective(forward, parts, place.axes, prescale * postscale, forward))

    def concatenate(self, axes, flat_parts):
        return concatenate(axes, flat_parts)

    def after(self, x, deps):
        # XLA's CPU pipeline drops optimization barriers: otherwise XLA puts
        # x's readers as early as they can go and lends the memory they free
        # to the work in between, which then waits for x.
        return _ffi_calls.after(x, deps)

    def pool(self, axes, parts, addend):
        # XLA's CPU code for it runs well below memory bandwidth (a zero
        # fill, then each part, then the add). The call's result is typed as
        # its addend: local, as the parts.
        return _ffi_calls.pool(parts, to_varying(addend, axes))

    def chunk_l1(self, axes, layout, local, exchanged, mask):
        # Reads each element once: the exchanged pool where a chunk was sent.
        return _ffi_calls.chunk_l1(
            local,
            to_varying(exchanged, axes),
            to_varying(mask, axes),
            chunk_size=layout.chunk_size,
        )

    def chunk_residual(self, axes, layout, local, mask, *, decay, skip, old):
        # Reads only the unsent chunks and writes into old's buffer (a skipped
        # step writes nothing).
        return _ffi_calls.chunk_residual(
            local,
            to_varying(mask, axes),
            to_varying(skip, axes),
            old,
            chunk_size=layout.chunk_size,
            decay=decay,
        )


def concatenate(axes, flat_parts):
    """The 1-D `flat_parts` (local over `axes`) one after another, on CPU.

    XLA's own CPU concatenate is slow: it ran at 0.3 s per device for the
    84 MB bucket of a 21M-parameter MLP, and where it fuses a small reduction
    that feeds it (a bias's gradient, summed over the batch) it computes that
    reduction for every element of the bucket: 5.5 s. Float buckets are
    copied together by `jaxcomm_pool` instead (without an addend), and the
    parts of other dtypes pass through `after` (which XLA cannot fuse) when
    they are small.
    """
    if len(flat_parts) < 2:
        return jnp.concatenate(flat_parts)
    return _concatenate(axes, *flat_parts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _concatenate(axes, *flat_parts):
    if flat_parts[0].dtype in (jnp.float32, jnp.float64):
        # Typed local over the reduction's axes, as the parts (as in pool).
        like = to_varying(jnp.zeros((), flat_parts[0].dtype), axes)
        return _ffi_calls.pool(list(flat_parts), like=like)
    return jnp.concatenate(
        [_ffi_calls.after(p, ()) if 0 < p.size < SMALL_PART else p for p in flat_parts]
    )


@_concatenate.defjvp
def _concatenate_jvp(axes, primals, tangents):
    # A concatenate is linear: its tangent is the concatenate of the tangents.
    return _concatenate(axes, *primals), jnp.concatenate(tangents)
