"""Reduction: an allreduce described once, checked when it is built, bound when traced.

What the transforms need from the collectives goes through here: they build
a :class:`Reduction` with :func:`reduction` when they are built (no JAX
backend starts: jax.distributed.initialize may come later) and call
:meth:`Reduction.bind` inside ``shard_map`` / ``pmap`` at trace time, where
the axis sizes, the backend and the schedule are known. The
:class:`BoundReduction` then reduces buckets, exchanges masked chunks, and
says what its wire costs and drops.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _validate
from jaxcomm.collectives import (
    _allreduce,
    _backend,
    _checks,
    _chunks,
    _ffi,
    _fp8,
    _scales,
    _xla,
)
from jaxcomm.collectives._axes import (
    AxisPlacement,
    bound_axes,
    is_vma_typed,
    normalize,
    placement,
)
from jaxcomm.collectives.varying import to_varying

DEFAULT_CHUNK_SIZE = 32768  # GradientFlow's chunk: 32K elements
# Bucket parts below this many elements are computed into buffers of their
# own before XLA's concatenate reads them (see _concatenate).
SMALL_PART = 1 << 16

# The ffi default, 4 MiB: big enough that per-collective latency is a small
# part of a bucket's time on Ethernet-class networks (alpha ~ 10-50 us, 4 MiB
# ~ 3 ms at 10 Gbps), small enough that ResNet-50's 100 MB of gradients make
# ~25 buckets, so the first ones can travel while backward still runs. The
# xla backend defaults to one collective per leaf: XLA's all-reduce combiner
# fuses those without copying, where our buckets cost a concatenate and a
# split (bench/overhead.py: 1.03x a per-leaf pmean unfused, 1.78x in 4 MiB
# buckets, ResNet-50 shapes on 8 CPU devices).
DEFAULT_BUCKET_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class Reduction:
    """An allreduce's options, checked; build it with :func:`reduction`.

    Attributes:
      axes: the reduced axis names, outermost first.
      op: ``"sum"`` or ``"mean"``.
      wire_dtype: the dtype that travels, or ``None`` for the input's.
      algorithm: as given (``"auto"`` is resolved by :meth:`bind`).
      backend: as given (``"auto"`` is resolved by :meth:`bind`).
      masked: chunk masks will be exchanged, so ``backend="auto"`` prefers
        ffi, the backend that sends only the selected chunks.
      chunk_size: elements per chunk of a mask.
    """

    axes: tuple
    op: str
    wire_dtype: np.dtype | None
    algorithm: str
    backend: str
    masked: bool
    chunk_size: int

    @property
    def narrow(self) -> bool:
        """A 16- or 8-bit wire: it rounds float32 values (what error feedback keeps)."""
        return _scales.is_narrow(self.wire_dtype)

    @property
    def fp8(self) -> bool:
        """An 8-bit float wire, scaled per device and part (see _fp8.py)."""
        return _fp8.is_fp8(self.wire_dtype)

    def with_op(self, op: str) -> Reduction:
        return dataclasses.replace(self, op=op)

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

    def bind(self) -> BoundReduction:
        """Resolves the backend and the schedule for the axes bound here.

        Raises:
          NameError: an axis is not bound here.
          RuntimeError: ``backend="ffi"`` has no handler on this platform.
        """
        backend = _backend.resolve_backend(
            self.backend, masked=self.masked, narrow=self.narrow, fp8=self.fp8
        )
        place = placement(self.axes)
        algorithm = _backend.resolve_algorithm(
            self.algorithm, backend, self.axes, narrow=self.narrow, fp8=self.fp8
        )
        return BoundReduction(self, place, backend, algorithm)


def reduction(
    axis_name,
    *,
    op: str = "sum",
    wire_dtype=None,
    algorithm: str = "auto",
    backend: str = "auto",
    masked: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Reduction:
    """Checks an allreduce's options without starting a JAX backend.

    Args:
      axis_name: axis name or tuple of names, as in :func:`jaxcomm.allreduce`.
      op, wire_dtype, algorithm, backend: as in :func:`jaxcomm.allreduce`.
      masked: chunk masks will be exchanged (``backend="auto"`` then prefers ffi).
      chunk_size: elements per chunk; checked only when ``masked``.

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
    wire = _checks.check_wire_dtype(wire_dtype)
    known = _backend.known_backend(
        backend, masked=masked, narrow=_scales.is_narrow(wire), fp8=_fp8.is_fp8(wire)
    )
    _checks.check_choice("op", op, _checks.OPS)
    _backend.check_algorithm(algorithm, known, axes)
    _fp8.check_options(wire, algorithm, known)
    if masked:
        chunk_size = _validate.check_positive_integer("chunk_size", chunk_size)
    return Reduction(axes, op, wire, algorithm, backend, masked, chunk_size)


class BoundReduction(NamedTuple):
    """A :class:`Reduction` at trace time: axis sizes, backend and schedule known.

    Attributes:
      reduction: what was asked for.
      place: this device's place on the reduced axes.
      backend: ``"xla"`` or ``"ffi"``.
      algorithm: the schedule: ``"psum"`` (XLA's own), ``"ring"``,
        ``"hierarchical"``, ``"direct"``, or ``"alltoall"`` (an FP8 wire's:
        all-to-all, float32 adds, all-gather; see _fp8.py).
    """

    reduction: Reduction
    place: AxisPlacement
    backend: str
    algorithm: str

    @property
    def _cpu_ffi(self) -> bool:
        """Whether jaxcomm's CPU handlers run this reduction, and with them its
        CPU-only calls (allreduce_parts, after, pool, chunk_l1, chunk_residual)."""
        return self.backend == "ffi" and jax.default_backend() == "cpu"

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
                    f"jaxcomm.local_grad(loss_fn, {axes if len(axes) > 1 else axes[0]!r}) "
                    "in place of jax.grad (it differentiates at params typed as varying). "
                    "A gradient that an optimizer state holds between "
                    "steps (optax.MultiSteps' accumulator) is per device: carry that "
                    "state with the specs of jaxcomm.state_specs"
                )

    @property
    def default_bucket_bytes(self) -> float:
        """The fusion threshold when none is given: one collective per leaf
        on xla, whose all-reduce combiner fuses without copies;
        ``DEFAULT_BUCKET_BYTES`` on ffi."""
        return 0 if self.backend == "xla" else DEFAULT_BUCKET_BYTES

    def scales(self, dtype) -> tuple[np.dtype, float, float]:
        """(wire dtype, prescale, postscale) for an input of `dtype`."""
        wire = _scales.wire_for(dtype, self.reduction.wire_dtype)
        cast = wire != np.dtype(dtype)
        return (wire, *_scales.scales(self.reduction.op, self.size, cast))

    def payload_bytes(self, elements, dtype, parts: int = 1):
        """Bytes this device puts into a collective of `elements` of `dtype`
        in `parts` parts (leaves of a bucket). An FP8 wire adds its scales:
        N(parts + 1) bytes, counted so that :meth:`bytes_sent` is exact
        (_fp8.scale_bytes)."""
        payload = elements * self.scales(dtype)[0].itemsize
        if self.reduction.fp8:
            payload += _fp8.scale_bytes(self.size, parts)
        return payload

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

        ffi on CPU reduces several parts where they lie, into one result
        each. Elsewhere the parts are concatenated (a fresh buffer, which the
        result may take over where the schedule allows) and the result is
        sliced back. A single part is the caller's array, which the result
        takes over only with `in_place` (False for a parameter of the step,
        which XLA would first copy: a computed operand that delays the call).
        `after`: arrays that must exist before anything reads the result
        (:meth:`after`).
        """
        if len(parts) > 1 and self._cpu_ffi:
            reduced = _allreduce.allreduce_parts(self, parts)
            return [self.after(r, after) if after else r for r in reduced]
        flat = _concatenate(self.reduction.axes, [jnp.ravel(p) for p in parts])
        # An FP8 wire scales each part by itself, as cast_error does for a leaf.
        sizes = tuple(int(np.size(p)) for p in parts)
        red = _allreduce.allreduce(self, flat, in_place=in_place or len(parts) > 1, parts=sizes)
        if after:  # on the call's own result, before any slice or reshape reads it
            red = self.after(red, after)
        out, offset = [], 0
        for p, n in zip(parts, sizes, strict=True):
            out.append(red[offset : offset + n].reshape(jnp.shape(p)))
            offset += n
        return out

    def after(self, x, deps):
        """`x`, read only once every array in `deps` exists. ffi on CPU holds
        it behind a call that waits for them (XLA's CPU pipeline drops
        optimization barriers): otherwise XLA puts x's readers as early as
        they can go and lends the memory they free to the work in between,
        which then waits for x. Elsewhere `x` as it is."""
        if self._cpu_ffi:
            return _ffi.after(x, deps)
        return x

    def pool(self, parts, addend):
        """The flat `parts` (of addend's dtype) one after another, plus
        `addend` (as long as all of them). ffi on CPU writes it in one
        custom call: XLA's CPU code for it runs well below memory bandwidth
        (a zero fill, then each part, then the add). Elsewhere XLA's."""
        if self._cpu_ffi:
            # The call's result is typed as its addend: local, as the parts.
            return _ffi.pool(parts, to_varying(addend, self.reduction.axes))
        out, offset = jnp.zeros(addend.shape, addend.dtype), 0
        for part in parts:
            out = jax.lax.dynamic_update_slice(out, part, (offset,))
            offset += part.size
        return out + addend

    def exchange(self, x, mask, *, max_chunks: int):
        """Reduces the chunks of flat `x` selected by `mask`, zeros elsewhere
        (the same on every device); returns (result, payload bytes this device
        sent, float32).

        `max_chunks` is how many chunks are usually selected: the xla backend
        and ffi on GPU pack that many (a static bound) and reduce all chunks
        when more are selected; ffi on CPU sends exactly the selected ones.
        """
        size, nchunks, chunk_size = x.size, mask.shape[0], self.reduction.chunk_size
        itemsize = self.scales(x.dtype)[0].itemsize
        if self.backend == "ffi" and _ffi.packs_exactly():
            lengths = jnp.minimum(chunk_size, size - chunk_size * jnp.arange(nchunks))
            payload = jnp.sum(jnp.where(mask, lengths, 0)).astype(jnp.float32) * itemsize
            return self.allreduce(x, chunk_mask=mask, unselected="zero"), payload
        scales = self.payload_bytes(0, x.dtype)  # an FP8 wire's exponents
        if max_chunks == nchunks:
            payload = nchunks * chunk_size * itemsize + scales
            return self.allreduce(x, chunk_mask=mask, unselected="zero"), jnp.float32(payload)
        many = jnp.sum(mask) > max_chunks
        reduced = jax.lax.cond(
            many,
            lambda v: self.allreduce(v, chunk_mask=mask, unselected="zero"),
            lambda v: self.allreduce(v, chunk_mask=mask, max_chunks=max_chunks, unselected="zero"),
            x,
        )
        # Bytes in float32: an int32 count overflows at 2 GiB of payload.
        chunks = jnp.where(many, nchunks, max_chunks).astype(jnp.float32)
        return reduced, chunks * (chunk_size * itemsize) + scales

    def chunk_elements(self, mask, size: int):
        """bool[size]: each chunk's flag in `mask` over its elements."""
        return _chunks.elements(mask, self.reduction.chunk_size, size)

    def chunk_l1(self, local, exchanged, mask):
        """float32[chunks]: each chunk's L1 norm, of `exchanged` (the
        result of :meth:`exchange`) where `mask` sent the chunk and of the
        `local` pool elsewhere. ffi on CPU reads each element once."""
        return _chunks.l1(
            local,
            exchanged,
            mask,
            chunk_size=self.reduction.chunk_size,
            axes=self.reduction.axes,
            cpu_ffi=self._cpu_ffi,
        )

    def chunk_residual(self, local, mask, *, decay: float, skip, old):
        """What stays behind after :meth:`exchange`: `decay * local` on the
        chunks `mask` did not send, zeros on the others; `old` where `skip`;
        shaped like `old`. ffi on CPU reads only the unsent chunks and
        writes into `old`'s buffer (a skipped step writes nothing)."""
        return _chunks.residual(
            local,
            mask,
            chunk_size=self.reduction.chunk_size,
            decay=decay,
            skip=skip,
            old=old,
            axes=self.reduction.axes,
            cpu_ffi=self._cpu_ffi,
        )

    def sum_from_mean(self, y):
        """A mean reduced by this reduction, times N back to the sum: in the
        type the collectives add in (float32, or float64 for float64), cast
        back to y's dtype."""
        return _xla.from_wire(y, y.dtype, self.size)

    def cast_error(self, v):
        """What the wire cast drops from v (a narrow wire's error feedback):
        v - decast(cast(v * prescale)) / prescale, with the prescale this
        reduction applies (1/N, or 2^-k with 2^k >= 2N where XLA adds in
        float16), computed exactly as the collectives cast. An FP8 wire's
        scale is this device's own for v (v is one part of a bucket):
        _fp8.cast_error."""
        if self.reduction.fp8:
            return _fp8.cast_error(v, self.reduction.wire_dtype)
        scale = self._wire_scale()
        acc = _xla.accumulator(v.dtype)
        sent = _xla.to_wire(v, self.reduction.wire_dtype, 1.0 / scale).astype(acc) * scale
        return (v.astype(acc) - sent).astype(v.dtype)

    def _wire_scale(self):
        """1 / the prescale before a narrow wire's cast."""
        n = self.size
        if self.backend == "xla" and self.algorithm in _xla.ADDS_IN_WIRE:
            return 1.0 / _xla.headroom_scales(self.reduction.wire_dtype, n, 1.0 / n, 1.0)[0]
        return n


def _concatenate(axes, flat_parts):
    """The 1-D `flat_parts` (local over `axes`) one after another.

    On CPU XLA's own concatenate is slow: it ran at 0.3 s per device for
    the 84 MB bucket of a 21M-parameter MLP, and where it fuses a small
    reduction that feeds it (a bias's gradient, summed over the batch) it
    computes that reduction for every element of the bucket: 5.5 s. With
    jaxcomm's CPU handlers, float buckets are copied together by
    `jaxcomm_pool` instead (without an addend), and the parts of other
    dtypes pass through `after` (which XLA cannot fuse) when they are small.
    """
    if len(flat_parts) < 2 or jax.default_backend() != "cpu" or not _ffi.available("cpu"):
        return jnp.concatenate(flat_parts)
    return _concatenate_cpu(axes, *flat_parts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _concatenate_cpu(axes, *flat_parts):
    if flat_parts[0].dtype in (jnp.float32, jnp.float64):
        # Typed local over the reduction's axes, as the parts (as in pool).
        like = to_varying(jnp.zeros((), flat_parts[0].dtype), axes)
        return _ffi.pool(list(flat_parts), like=like)
    return jnp.concatenate(
        [_ffi.after(p, ()) if 0 < p.size < SMALL_PART else p for p in flat_parts]
    )


@_concatenate_cpu.defjvp
def _concatenate_cpu_jvp(axes, primals, tangents):
    # A concatenate is linear: its tangent is the concatenate of the tangents.
    return _concatenate_cpu(axes, *primals), jnp.concatenate(tangents)
