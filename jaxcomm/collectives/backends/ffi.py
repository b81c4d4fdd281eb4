"""What jaxcomm's two custom-call backends share: the schedules of
xla_ffi/algorithm/, one custom call per collective, psum's derivatives.

How a call finds its peers and which calls exist beside the collectives
differ by platform: cpu_ffi.py and cuda_ffi.py.
"""

from __future__ import annotations

from jaxcomm.collectives import _ffi_calls
from jaxcomm.collectives._linear import linear_collective
from jaxcomm.collectives.backends.base import Backend

# The ffi default, 4 MiB: big enough that per-collective latency is a small
# part of a bucket's time on Ethernet-class networks (alpha ~ 10-50 us, 4 MiB
# ~ 3 ms at 10 Gbps), small enough that ResNet-50's 100 MB of gradients make
# ~25 buckets, so the first ones can travel while backward still runs.
DEFAULT_BUCKET_BYTES = 4 * 2**20


class FfiBackend(Backend):
    """jaxcomm's custom calls (xla_ffi/). ``algorithm="auto"`` is the direct
    schedule, which beats the ring on one host (bench/allreduce.py)."""

    name = "ffi"
    algorithms = ("auto", "ring", "hierarchical", "direct", "alltoall")  # alltoall: GPU
    default_bucket_bytes = DEFAULT_BUCKET_BYTES

    @classmethod
    def check_options(cls, algorithm: str, wire) -> None:
        if wire.scaled:
            raise ValueError(
                f"wire_dtype={wire.name} runs on backend='xla' only (an all-to-all and an "
                "all-gather that add in float32); the ffi handlers take float16 and bfloat16 "
                "wires. Use backend='xla' or 'auto'"
            )
        super().check_options(algorithm, wire)

    def algorithm(self, requested: str, axes: tuple, wire) -> str:
        self.check_options(requested, wire)
        return "direct" if requested == "auto" else requested

    # How a call finds its peers, per platform.

    def peers(self, x, place) -> dict:
        """The attribute by which a handler finds its peers (_peers.py)."""
        raise NotImplementedError

    def coords(self, place):
        """The int32 [group, rank] operand."""
        raise NotImplementedError

    def aliases_input(self, algorithm: str) -> bool:
        """Whether an unmasked allreduce may write its result into its input."""
        return False

    def _call(self, bound, flat, **options):
        wire, prescale, postscale = bound.scales(flat.dtype)
        return _ffi_calls.allreduce(
            flat,
            self.coords(bound.place),
            self.peers(flat, bound.place),
            bound.place,
            algorithm=bound.algorithm,
            wire=wire,
            prescale=prescale,
            postscale=postscale,
            **options,
        )

    def allreduce(self, bound, flat, *, in_place=False, parts=None):
        del parts  # every part travels in one wire dtype, scaled alike
        aliased = in_place and self.aliases_input(bound.algorithm)

        def forward(v):
            return self._call(bound, v, aliased=aliased)

        # The custom call would otherwise have no transpose; make it psum's.
        _, prescale, postscale = bound.scales(flat.dtype)
        return linear_collective(forward, flat, bound.place.axes, prescale * postscale, forward)

    def masked_allreduce(self, bound, flat, layout, mask, *, max_chunks, zero):
        # The call packs, reduces and unpacks the chunks itself, and zeros
        # the unselected ones without a pass over `flat`.
        return self._call(
            bound,
            flat,
            chunk_mask=mask,
            chunk_size=layout.chunk_size,
            max_chunks=max_chunks,
            zero_unselected=zero,
        )

    def reduce_scatter(self, bound, flat):
        wire, prescale, postscale = bound.scales(flat.dtype)
        return _ffi_calls.reduce_scatter(
            flat, *self._reach(bound, flat), wire=wire, prescale=prescale, postscale=postscale
        )

    def all_gather(self, bound, flat):
        return _ffi_calls.all_gather(
            flat, *self._reach(bound, flat), wire=bound.scales(flat.dtype)[0]
        )

    def _reach(self, bound, flat) -> tuple:
        """(coords, peers, place): how a call on `flat` finds its peers."""
        return self.coords(bound.place), self.peers(flat, bound.place), bound.place
