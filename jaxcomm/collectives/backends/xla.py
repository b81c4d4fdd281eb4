"""The xla backend: jaxcomm's collectives from JAX's own (psum, ppermute,
all_to_all, ...). Portable: CPU, GPU, TPU, several processes."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from jaxcomm import _jax_compat
from jaxcomm.collectives import _fp8, _quantized, _xla
from jaxcomm.collectives._linear import linear_collective
from jaxcomm.collectives.backends.base import Backend
from jaxcomm.collectives.wire import Wire

# One schedule per resolved algorithm, as nccl-tests keeps one function per
# collective: (flat, place, wire, prescale, postscale, parts) -> reduced.
_SCHEDULES = {
    "psum": lambda v, place, w, pre, post, parts: _xla.psum_allreduce(v, place, w, pre, post),
    "ring": lambda v, place, w, pre, post, parts: _xla.ring_allreduce(v, place, w, pre, post),
    "hierarchical": lambda v, place, w, pre, post, parts: _xla.hierarchical_allreduce(
        v, place, w, pre, post
    ),
    _fp8.ALGORITHM: lambda v, place, w, pre, post, parts: (
        _quantized.allreduce if Wire.of(w).quantized else _fp8.allreduce
    )(v, place, w, pre, post, parts),
}


class XlaBackend(Backend):
    """JAX's collectives. ``algorithm="auto"`` is ``lax.psum`` (XLA picks
    its own all-reduce), or the ring over ``ppermute`` for a 16-bit wire
    across CPU processes; a scaled wire (FP8, int8, int4) has its own
    schedule (_fp8.py, _quantized.py)."""

    name = "xla"
    algorithms = ("auto", "ring", "hierarchical")
    # XLA's all-reduce combiner fuses one collective per leaf without
    # copying, where buckets cost a concatenate and a split (docs/design.md).
    default_bucket_bytes = 0

    @classmethod
    def check_options(cls, algorithm: str, wire) -> None:
        if algorithm == "direct":
            raise ValueError(
                "algorithm='direct' is the shared-memory schedule of backend='ffi'; "
                "with backend='xla' use 'auto' (lax.psum), 'ring' or 'hierarchical'"
            )
        if wire.scaled and algorithm != "auto":
            raise ValueError(
                f"wire_dtype={wire.name} has one schedule (an all-to-all and an all-gather that "
                f"add in float32, algorithm='auto'); algorithm={algorithm!r} would round or add "
                f"partial sums in {wire.name}"
            )
        super().check_options(algorithm, wire)

    def algorithm(self, requested: str, axes: tuple, wire) -> str:
        self.check_options(requested, wire)
        if wire.scaled:
            return _fp8.ALGORITHM
        cpu_processes = jax.process_count() > 1 and jax.default_backend() == "cpu"
        if requested == "auto":
            # Across processes on CPU, lax.psum runs in gloo, which adds
            # float16 slowly and gets bfloat16 widened to float32 by XLA; the
            # ring sends 16 bits and adds in float32 (bench/network.py).
            return "ring" if wire.narrow and cpu_processes else "psum"
        if requested == "hierarchical" and cpu_processes and _jax_compat.jaxlib_version() < (0, 12):
            _warn_hierarchical_wrong_results()
        return requested

    def adds_in_wire(self, algorithm: str) -> bool:
        return algorithm in _xla.ADDS_IN_WIRE

    def allreduce(self, bound, flat, *, in_place=False, parts=None):
        del in_place  # XLA decides buffers itself
        place, algorithm = bound.place, bound.algorithm
        wire, prescale, postscale = bound.scales(flat.dtype)
        if algorithm == "psum" and wire == flat.dtype:
            # Nothing is rounded to a wire: lax.psum's own derivatives
            # (forward mode included) are exact. A narrow wire takes
            # linear_collective below, whose backward pass is this same mean:
            # psum's transpose would cast the cotangent times postscale (2^k/N,
            # see _xla.headroom_scales) to float16, which overflows long
            # before the cotangent does.
            return _xla.psum_allreduce(flat, place, wire, prescale, postscale)

        def forward(v):
            return self._schedule(bound, v, parts)

        # The ring's ppermutes would otherwise transpose to something other
        # than psum's transpose; make all schedules agree with it.
        return linear_collective(forward, flat, place.axes, prescale * postscale, forward)

    def _schedule(self, bound, flat, parts=None):
        wire, prescale, postscale = bound.scales(flat.dtype)
        return _SCHEDULES[bound.algorithm](flat, bound.place, wire, prescale, postscale, parts)

    def masked_allreduce(self, bound, flat, layout, mask, *, max_chunks, zero):
        if zero:
            # Zeroed before the reduction, so that the result unpacks into zeros.
            flat = jnp.where(layout.elements(mask), flat, jnp.zeros((), flat.dtype))
        reduce = lambda v: self._schedule(bound, v)  # noqa: E731
        return _masked(flat, layout, mask, max_chunks, reduce, zero=zero)

    def reduce_scatter(self, bound, flat):
        wire, prescale, postscale = bound.scales(flat.dtype)
        return _xla.reduce_scatter(flat, bound.place, wire, prescale, postscale)

    def all_gather(self, bound, flat):
        return _xla.all_gather(flat, bound.place, bound.scales(flat.dtype)[0])


class XlaCpuBackend(XlaBackend):
    """XLA's collectives on CPU where jaxcomm's CPU module is installed: a
    bucket's parts are copied together by jaxcomm's kernel (XLA's own CPU
    concatenate is slow, :func:`cpu_ffi.concatenate`)."""

    def concatenate(self, axes, flat_parts):
        from jaxcomm.collectives.backends import cpu_ffi

        return cpu_ffi.concatenate(axes, flat_parts)


def _masked(flat, layout, mask, max_chunks, reduce, *, zero=False):
    """Reduces only the selected chunks of `flat`; the others keep their
    local values, or zeros (then the result is replicated). With
    `max_chunks`, `mask` selects at most that many chunks."""
    nchunks, chunk_size = layout.nchunks, layout.chunk_size
    chunks = layout.as_rows(flat)
    # Zeros typed as replicated (zeros_like would be varying), so that a zeroed
    # result is replicated like the reduction and out_specs=P() accepts it.
    rest = jnp.zeros(chunks.shape, chunks.dtype) if zero else chunks
    if max_chunks is None:
        reduced = reduce(chunks.reshape(-1)).reshape(nchunks, chunk_size)
        out = jnp.where(mask[:, None], reduced, rest)
    else:
        index = jnp.nonzero(mask, size=max_chunks, fill_value=nchunks)[0]
        packed = chunks.at[index].get(mode="fill", fill_value=0)
        reduced = reduce(packed.reshape(-1)).reshape(max_chunks, chunk_size)
        # Unpacked by a gather of each chunk's slot, which XLA fuses with the
        # unpadding; a scatter into `rest` would first write a whole pool.
        # The caller unselected the chunks past the bound, so each selected
        # chunk has a slot below max_chunks.
        slot = jnp.cumsum(mask, dtype=jnp.int32) - 1
        back = reduced.at[jnp.clip(slot, 0, max_chunks - 1)].get(mode="clip")
        out = jnp.where(mask[:, None], back, rest)
    return out.reshape(-1)[: layout.size]


@functools.cache
def _warn_hierarchical_wrong_results() -> None:
    warnings.warn(
        "algorithm='hierarchical' with backend='xla' across processes on CPU: with jaxlib "
        "0.10.2 the psum_scatter, psum and all_gather it runs (plain JAX, gloo) sometimes "
        "return a block of wrong values; none were seen with jaxlib 0.12. Use 'auto' or "
        "'ring' here, or a newer jaxlib (docs/faults.md).",
        UserWarning,
        stacklevel=4,
    )
