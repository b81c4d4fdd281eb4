"""Reduction: an allreduce described once, checked when it is built, bound when traced.

What the transforms need from the collectives goes through here: they build
a :class:`Reduction` with :func:`reduction` when they are built (no JAX
backend starts: jax.distributed.initialize may come later) and call
:meth:`Reduction.bind` inside ``shard_map`` / ``pmap`` at trace time, where
the axis sizes, the backend and the schedule are known. The
:class:`BoundReduction` keeps the semantics (scales, bytes, what the wire
drops) and hands every operation to its backend (backends/).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.collectives import _allreduce, _checks, _fp8, _quantized, _xla, backends
from jaxcomm.collectives._axes import (
    AxisPlacement,
    bound_axes,
    check_bound,
    is_vma_typed,
    normalize,
    placement,
)
from jaxcomm.collectives.backends import DEFAULT_BUCKET_BYTES, Backend
from jaxcomm.collectives.chunk_layout import DEFAULT_CHUNK_SIZE, ChunkLayout, check_chunk_size
from jaxcomm.collectives.varying import varying_axes
from jaxcomm.collectives.wire import Wire

# Tests set this to start exchanges across steps between the devices of one
# process too (Reduction.starts_between_steps).
START_IN_ONE_PROCESS = False

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHUNK_SIZE",
    "BoundReduction",
    "Reduction",
    "reduction",
]


@dataclasses.dataclass(frozen=True)
class Reduction:
    """An allreduce's options, checked; build it with :func:`reduction`.

    Attributes:
      axes: the reduced axis names, outermost first.
      op: ``"sum"`` or ``"mean"``.
      wire: what travels (:class:`jaxcomm.collectives.Wire`).
      algorithm: as given (``"auto"`` is resolved by :meth:`bind`).
      backend: as far as it is decided without a platform (backends.check):
        a :class:`jaxcomm.collectives.Backend`, ``"xla"``, ``"ffi"``, or
        ``"auto"``, which :attr:`resolved_backend` finishes at trace time.
      masked: chunk masks will be exchanged, so ``backend="auto"`` prefers
        ffi, the backend that sends only the selected chunks.
      chunk_size: elements per chunk of a mask.
      started: the reduction will be started in one step and finished in a
        later one where it can (:meth:`BoundReduction.allreduce_start`), so
        ``backend="auto"`` prefers the backend that can.
    """

    axes: tuple
    op: str
    wire: Wire
    algorithm: str
    backend: str | Backend
    masked: bool
    chunk_size: int
    started: bool = False

    @property
    def wire_dtype(self) -> np.dtype | None:
        """The dtype that travels, or ``None`` for the input's."""
        return self.wire.dtype

    @property
    def narrow(self) -> bool:
        """A 16- or 8-bit wire: it rounds float32 values (what error feedback keeps)."""
        return self.wire.narrow

    @property
    def fp8(self) -> bool:
        """An 8-bit float wire, scaled per device and part (see _fp8.py)."""
        return self.wire.fp8

    def with_op(self, op: str) -> Reduction:
        return dataclasses.replace(self, op=op)

    def layout(self, size: int) -> ChunkLayout:
        """How a pool of `size` elements is cut into this reduction's chunks."""
        return ChunkLayout(int(size), self.chunk_size)

    def check_dtypes(self, tree, argument: str = "gradient") -> None:
        """Raises TypeError naming (by its path) the first leaf of `tree` of a
        dtype the collectives do not take."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = f"{argument}{jax.tree_util.keystr(path)}"
            _checks.check_input_dtype(name, jnp.result_type(leaf))

    def is_bound(self) -> bool:
        """Whether all of :attr:`axes` are bound here (inside shard_map / pmap)."""
        bound = bound_axes()
        return all(a in bound for a in self.axes)

    def check_bound(self, *, mesh: bool = False) -> None:
        """Raises the ValueError every entry point gives where an axis of
        :attr:`axes` is not bound here, naming the axes that are; with
        `mesh`, the current mesh's axes count too (a transform's init)."""
        check_bound(self.axes, mesh=mesh)

    @property
    def resolved_backend(self) -> Backend:
        """The backend that runs here: the one place that finishes the choice
        ``reduction()`` made. Not cached: it needs the platform, which may
        differ from one trace of the same transform to the next (a CPU and a
        GPU computation in one process)."""
        return backends.resolve(
            self.backend, masked=self.masked, wire=self.wire, started=self.started
        )

    @property
    def starts_async(self) -> bool:
        """Whether an allreduce can be started in one step and finished in a
        later one here: jaxcomm's CPU transport and a wire it reduces itself."""
        return self.resolved_backend.starts_async and self.wire.can_start

    @property
    def starts_between_steps(self) -> bool:
        """Whether a double-buffered transform starts its exchange at the end
        of one step and finishes it in the next: where :attr:`starts_async`,
        across processes. Between the devices of one process the exchange is
        a copy in memory, and starting it would only add copies (into the
        handler, out of it): there it runs in the step. Decided by the
        platform and the job, not the axes, so init and update agree."""
        return self.starts_async and (jax.process_count() > 1 or START_IN_ONE_PROCESS)

    def bind(self) -> BoundReduction:
        """Resolves the backend and the schedule for the axes bound here.

        Raises:
          ValueError: an axis is not bound here.
          RuntimeError: ``backend="ffi"`` has no handler on this platform.
        """
        backend = self.resolved_backend
        place = placement(self.axes)
        algorithm = backend.algorithm(self.algorithm, self.axes, self.wire)
        return BoundReduction(self, place, backend, algorithm)


def reduction(
    axis_name,
    *,
    op: str = "sum",
    wire_dtype=None,
    algorithm: str = "auto",
    backend: str | Backend = "auto",
    masked: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    started: bool = False,
) -> Reduction:
    """Checks an allreduce's options without starting a JAX backend.

    Args:
      axis_name: axis name or tuple of names, as in :func:`jaxcomm.allreduce`.
      op, wire_dtype, algorithm, backend: as in :func:`jaxcomm.allreduce`.
      masked: chunk masks will be exchanged (``backend="auto"`` then prefers ffi).
      chunk_size: elements per chunk; checked only when ``masked``.
      started: it will be started in one step and finished in a later one
        where the backend can (``backend="auto"`` then prefers ffi on CPU).

    Returns:
      A :class:`Reduction`.

    Examples:
      >>> from jaxcomm.collectives import reduction
      >>> r = reduction("data", op="mean", wire_dtype="float16")
      >>> r.axes, r.wire_dtype.name, r.narrow
      (('data',), 'float16', True)
      >>> reduction("data", op="max")
      Traceback (most recent call last):
      ...
      ValueError: op='max' is not supported; use one of ('sum', 'mean')
    """
    axes = normalize(axis_name)
    wire = Wire.of(wire_dtype)
    _checks.check_choice("op", op, _checks.OPS)
    backend = backends.check(backend, algorithm, axes, wire, masked=masked, started=started)
    if masked:
        chunk_size = check_chunk_size(chunk_size)
    return Reduction(axes, op, wire, algorithm, backend, masked, chunk_size, started)


class BoundReduction(NamedTuple):
    """A :class:`Reduction` at trace time: axis sizes, backend and schedule known.

    Attributes:
      reduction: what was asked for.
      place: this device's place on the reduced axes.
      backend: the :class:`jaxcomm.collectives.Backend` that runs it
        (``backend.name``: ``"xla"`` or ``"ffi"``).
      algorithm: the schedule: ``"psum"`` (XLA's own), ``"ring"``,
        ``"hierarchical"``, ``"direct"``, or ``"alltoall"`` (a scaled wire's:
        all-to-all, float32 adds, all-gather; see _fp8.py, _quantized.py).
    """

    reduction: Reduction
    place: AxisPlacement
    backend: Backend
    algorithm: str

    @property
    def size(self) -> int:
        """Devices on the reduced axes (N)."""
        return self.place.size

    def check_local(self, tree, argument: str = "gradient") -> None:
        """Raises ValueError naming the first leaf of `tree` typed as the same
        on every device of the axes.

        Such a gradient was already reduced: under ``shard_map`` JAX's grad of
        replicated params sums over the devices itself, and reducing it again
        returns N times the mean. Types exist only in ``shard_map`` with
        ``check_vma=True`` (the default); under ``pmap`` or ``check_vma=False``
        nothing can be told, and nothing is checked.
        """
        axes = self.reduction.axes
        if not is_vma_typed(self.place.rank, axes):
            return
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if np.size(leaf) and not is_vma_typed(leaf, axes):  # an empty leaf sends nothing
                name = f"{argument}{jax.tree_util.keystr(path)}"
                raise ValueError(
                    f"{name} is typed as the same on every device of {axes}: it has already "
                    "been reduced (jax.grad of params that entered shard_map replicated sums "
                    "over the devices), so reducing it again would give N times the mean. "
                    "Take this device's own gradient with "
                    f"jaxcomm.value_and_grad(loss_fn, {axes if len(axes) > 1 else axes[0]!r}) "
                    "in place of jax.value_and_grad or nnx.value_and_grad (or jaxcomm.grad, "
                    "jaxcomm.local_grad: they differentiate at params typed as varying). "
                    "A gradient that an optimizer state holds between "
                    "steps (optax.MultiSteps' accumulator) is per device: carry that "
                    "state with the specs of jaxcomm.state_specs"
                )

    @property
    def wire(self) -> Wire:
        """What travels (the reduction's :class:`jaxcomm.collectives.Wire`)."""
        return self.reduction.wire

    @property
    def default_bucket_bytes(self) -> float:
        """The fusion threshold when none is given (the backend's)."""
        return self.backend.default_bucket_bytes

    def layout(self, size: int) -> ChunkLayout:
        """How a pool of `size` elements is cut into chunks."""
        return self.reduction.layout(size)

    def scales(self, dtype) -> tuple[np.dtype, float, float]:
        """(wire dtype, prescale, postscale) for an input of `dtype`."""
        return self.reduction.wire.scales(self.reduction.op, self.size, dtype)

    def payload_bytes(self, elements, dtype, parts: int = 1):
        """Bytes this device puts into a collective of `elements` of `dtype`
        in `parts` parts (leaves of a bucket), counted so that
        :meth:`bytes_sent` is exact: a scaled wire's codes and scales
        (:meth:`Wire.payload_bytes`)."""
        return self.reduction.wire.payload_bytes(elements, dtype, self.size, parts)

    def bytes_sent(self, payload) -> jax.Array:
        """Per-device bytes on the wire for an allreduce of `payload` bytes
        under a bandwidth-optimal schedule: 2(N-1)/N x payload flat,
        2(L-1)/L x payload + 2(M-1)/M x payload/L hierarchical (the
        nccl-tests busbw convention)."""
        payload = jnp.asarray(payload, jnp.float32)
        if self.algorithm == "hierarchical":
            inter, intra = self.place.shape
            return payload * (2 * (intra - 1) / intra + 2 * (inter - 1) / (inter * intra))
        n = self.size
        return payload * (2 * (n - 1) / n)

    def allreduce(self, x, **kwargs):
        """:func:`jaxcomm.allreduce` of `x` with these options; keyword
        arguments are its per-call ones (chunk_mask, max_chunks, unselected)."""
        return _allreduce.allreduce(self, x, **kwargs)

    def allreduce_bucket(self, parts, *, in_place: bool = True, after=()):
        """One collective over `parts` (arrays of one dtype) as if they lay
        one after another; returns the reduced parts, shaped as given.

        A single part is the caller's array, which the result takes over only
        with `in_place` (False for a parameter of the step, which XLA would
        first copy: a computed operand that delays the call). `after`: arrays
        that must exist before anything reads the result (:meth:`after`).
        """
        return self.backend.allreduce_bucket(self, parts, in_place=in_place, after=after)

    def all_gather(self, x):
        """[N, *x.shape]: every device's `x` (any dtype), in rank order, typed
        as the same on every device where types say so (shard_map) and `x`
        varies over all the reduced axes."""
        axes = self.reduction.axes
        to = "invarying" if set(axes) <= set(varying_axes(x)) else "varying"
        return self.backend.all_gather_rows(self, x, to=to)

    @property
    def starts_async(self) -> bool:
        """Whether :meth:`allreduce_start` can run here (Reduction.starts_async)."""
        return self.reduction.starts_async

    def allreduce_start(self, flat, *, chunk_mask=None):
        """Starts the reduction of 1-D `flat` (this reduction's op and wire)
        and returns at once a handle, an int32 array for
        :meth:`allreduce_done` in this or a later execution of the program.
        The exchange runs on jaxcomm's threads meanwhile. Each handle is
        finished exactly once, in the process that started it. With
        `chunk_mask` (one flag per chunk of :meth:`layout`) only the selected
        chunks travel, and the result is zero on the others, as
        :meth:`exchange`'s."""
        if not self.starts_async:
            raise ValueError(
                "an allreduce started in one step and finished in another needs "
                "backend='ffi' on CPU and a wire the handlers cast (none, float16, "
                f"bfloat16); this one runs on backend={self.backend.name!r} with "
                f"wire_dtype={self.reduction.wire.name}"
            )
        return self.backend.allreduce_start(self, flat, chunk_mask=chunk_mask)

    def allreduce_done(self, handle, like, *, missing_ok: bool = False):
        """(result, found): the result of :meth:`allreduce_start`'s reduction,
        of `like`'s shape and dtype (the started array, or its
        ShapeDtypeStruct), typed replicated over every axis as the handle is
        (where the started array also varied over axes not reduced, type it
        back with ``to_varying``), and int32 1. A handle this job has not in
        flight (finished already, or restored from another job's state) is an
        error; with `missing_ok`, found is 0 and the result unwritten, for the
        caller to reduce what it kept."""
        return self.backend.allreduce_done(self, handle, like, missing_ok=missing_ok)

    def after(self, x, deps):
        """`x`, read only once every array in `deps` exists, where the
        backend's platform needs telling (Backend.after)."""
        return self.backend.after(x, deps)

    def pool(self, parts, addend):
        """The flat `parts` (of addend's dtype) one after another, plus
        `addend` (as long as all of them), in one pass where the backend
        has one (Backend.pool)."""
        return self.backend.pool(self.reduction.axes, parts, addend)

    def exchange(self, x, mask, *, max_chunks: int):
        """Reduces the chunks of flat `x` selected by `mask`, zeros elsewhere
        (the same on every device); returns (result, payload bytes this device
        sent, float32).

        `max_chunks` is how many chunks are usually selected: a backend that
        cannot send exactly the selected chunks packs that many (a static
        bound) and reduces all chunks when more are selected.
        """
        payload = self.exchange_payload(x, mask, max_chunks=max_chunks)
        nchunks = self.layout(x.size).nchunks
        if self.backend.sends_only_selected or max_chunks == nchunks:
            return self.allreduce(x, chunk_mask=mask, unselected="zero"), payload
        reduced = jax.lax.cond(
            jnp.sum(mask) > max_chunks,
            lambda v: self.allreduce(v, chunk_mask=mask, unselected="zero"),
            lambda v: self.allreduce(v, chunk_mask=mask, max_chunks=max_chunks, unselected="zero"),
            x,
        )
        return reduced, payload

    def exchange_payload(self, x, mask, *, max_chunks: int):
        """float32: the bytes this device sends in :meth:`exchange` of `x`
        (or its ShapeDtypeStruct) on `mask`; a started exchange
        (:meth:`allreduce_start` with the mask) sends the selected chunks."""
        layout = self.layout(np.size(x))
        nchunks, chunk_size = layout.nchunks, layout.chunk_size
        dtype = jnp.result_type(x)
        if self.backend.sends_only_selected:
            itemsize = self.scales(dtype)[0].itemsize
            return (layout.selected_elements(mask) * itemsize).astype(jnp.float32)
        # Bytes in float32: an int32 count overflows at 2 GiB of payload.
        every = jnp.float32(self.payload_bytes(nchunks * chunk_size, dtype))  # FP8 scales too
        if max_chunks == nchunks:
            return every
        bounded = jnp.float32(self.payload_bytes(max_chunks * chunk_size, dtype))
        return jnp.where(jnp.sum(mask) > max_chunks, every, bounded)

    def chunk_l1(self, local, exchanged, mask):
        """float32[chunks]: each chunk's L1 norm, of `exchanged` (the
        result of :meth:`exchange`) where `mask` sent the chunk and of the
        `local` pool elsewhere."""
        layout = self.layout(local.size)
        return self.backend.chunk_l1(self.reduction.axes, layout, local, exchanged, mask)

    def chunk_residual(self, local, mask, *, decay: float, skip, old):
        """What stays behind after :meth:`exchange`: `decay * local` on the
        chunks `mask` did not send, zeros on the others; `old` where `skip`;
        shaped like `old`."""
        layout = self.layout(local.size)
        return self.backend.chunk_residual(
            self.reduction.axes, layout, local, mask, decay=decay, skip=skip, old=old
        )

    def sum_from_mean(self, y):
        """A mean reduced by this reduction, times N back to the sum: in the
        type the collectives add in (float32, or float64 for float64), cast
        back to y's dtype."""
        return _xla.from_wire(y, y.dtype, self.size)

    def cast_error(self, v):
        """What the wire cast drops from v (a narrow wire's error feedback):
        v - decast(cast(v * prescale)) / prescale, with the prescale this
        reduction applies (1/N, or 2^-k with 2^k >= 2N where the backend adds
        in float16), computed exactly as the collectives cast. A scaled
        wire's scales are this device's own for v (v is one part of a
        bucket): _fp8.cast_error, _quantized.cast_error."""
        wire = self.reduction.wire_dtype
        if self.reduction.fp8:
            return _fp8.cast_error(v, wire)
        if self.reduction.wire.quantized:
            return _quantized.cast_error(v, wire)
        n = self.size
        scale = n
        if self.backend.adds_in_wire(self.algorithm):
            scale = 1.0 / _xla.headroom_scales(wire, n, 1.0 / n, 1.0)[0]
        acc = _xla.accumulator(v.dtype)
        sent = _xla.to_wire(v, wire, 1.0 / scale).astype(acc) * scale
        return (v.astype(acc) - sent).astype(v.dtype)
