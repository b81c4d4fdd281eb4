"""sparseloco: DiLoCo whose outer step sends a sparse, 2-bit pseudo-gradient.

Each device adds its pseudo-gradient to an error-feedback buffer, sends the
``k`` largest entries of every chunk of it, their values quantised to a few
bits, and keeps what it did not send; the averaged sparse pseudo-gradient
steps the global params with a plain learning rate (Sarfi et al. 2025). The
decayed buffer stands in for DiLoCo's outer momentum.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _validate
from jaxcomm.collectives import to_varying, varying_axes
from jaxcomm.state import per_device
from jaxcomm.transforms._buckets import buckets_payload, leaf_buckets, reduce_in_buckets
from jaxcomm.transforms.diloco import diloco
from jaxcomm.transforms.outer_step import OuterStep

INDEX_BYTES = 2  # a position within a chunk, as uint16: chunk_size <= 65536
SCALE_BYTES = 4  # a float32 scale per chunk
VALUE_BITS = (2, 4, 8)
EXCHANGES = ("auto", "all_gather", "dense")


def leaf_plan(elements: int, chunk_size: int, density: float) -> tuple[int, int, int]:
    """(chunks, chunk length, entries sent per chunk) for a leaf of ``elements``.

    A leaf shorter than ``chunk_size`` is one chunk; the last chunk of a
    longer one is padded with zeros. ``k = max(1, floor(density * length))``,
    so a chunk sends at most ``density`` of it, but one entry at least.

    Examples:
      >>> leaf_plan(10_000, 4096, 0.02), leaf_plan(7, 4096, 0.02)
      ((3, 4096, 81), (1, 7, 1))
    """
    if elements == 0:
        return 0, 0, 0
    length = min(chunk_size, elements)
    return -(-elements // length), length, max(1, int(density * length))


def payload_bytes(sizes, *, chunk_size: int, density: float, value_bits: int) -> int:
    """Bytes one device puts into the all-gather for leaves of ``sizes`` elements.

    Per chunk: a float32 scale, ``k`` uint16 positions, ``k`` values of
    ``value_bits`` packed into bytes.

    Examples:
      >>> payload_bytes([4096], chunk_size=4096, density=0.02, value_bits=2)  # 4 + 162 + 21
      187
    """
    total = 0
    for n in sizes:
        chunks, _, k = leaf_plan(int(n), chunk_size, density)
        total += chunks * (SCALE_BYTES + INDEX_BYTES * k + math.ceil(k * value_bits / 8))
    return total


def choose_exchange(payload: float, dense_bytes: float, devices: int) -> str:
    """``"all_gather"`` of the sparse payloads, or ``"dense"``: an allreduce of
    each device's chosen values scattered into the fragment's shape.

    By the bytes each device sends on a ring: ``(N - 1) * payload`` for the
    all-gather, which grows with N, and ``2 (N - 1) / N * dense_bytes`` for
    the allreduce. Ties go to the all-gather.

    Examples:
      >>> choose_exchange(187, 4 * 4096, 8), choose_exchange(187, 4 * 4096, 256)
      ('all_gather', 'dense')
    """
    return "all_gather" if devices * payload <= 2 * dense_bytes else "dense"


@dataclasses.dataclass(frozen=True)
class SparseOuter(OuterStep):
    """SparseLoCo's outer step, for :func:`jaxcomm.diloco`'s ``outer``; made by
    :func:`sparse_outer`, which documents the fields. It keeps its own error
    feedback, and its all-gather finishes within the sync step."""

    name: ClassVar[str] = "jaxcomm.sparse_outer"
    can_start: ClassVar[bool] = False

    learning_rate: float
    density: float
    chunk_size: int
    value_bits: int
    error_decay: float
    exchange: str

    # -- the OuterStep diloco runs on each fragment (its leaves as lists) -----

    def init(self, leaves):
        del leaves
        return optax.EmptyState()

    def init_error(self, parts, comm):
        zeros = tuple([jnp.zeros(jnp.shape(x), jnp.float32) for x in part] for part in parts)
        return per_device.per_device_copies(zeros, comm, "error feedback", like=tuple(parts))

    def apply(self, mean, outer_state, anchor):
        del anchor
        return [(-self.learning_rate * m).astype(m.dtype) for m in mean], outer_state

    def reduce(self, anchor, local, error, bound, theta):
        """The averaged sparse pseudo-gradient (in the params' dtypes) and the
        error buffers after what this device sent."""
        acc = [
            self.error_decay * e + (g - x).astype(jnp.float32)
            for g, x, e in zip(anchor, local, error, strict=True)
        ]
        picks = [self._compress(x) for x in acc]
        mine = [
            _scatter(p[0], p[3], jnp.shape(x), self._length(x))
            for p, x in zip(picks, acc, strict=True)
        ]
        error = [x - s for x, s in zip(acc, mine, strict=True)]
        if self._exchange(anchor, bound) == "dense":
            mean = reduce_in_buckets(mine, bound, theta)[0]
        else:
            mean = self._gathered_mean(picks, acc, bound)
        return [m.astype(jnp.result_type(g)) for m, g in zip(mean, anchor, strict=True)], error

    def cost(self, anchor, bound, theta):
        """(payload bytes, bytes on the wire, collectives, elements sent) of a sync."""
        sizes = [int(np.size(x)) for x in anchor]
        sent = sum(
            c * k for c, _, k in (leaf_plan(n, self.chunk_size, self.density) for n in sizes)
        )
        if self._exchange(anchor, bound) == "dense":
            dense = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32) for x in anchor]
            buckets = leaf_buckets(dense, theta)
            payload = buckets_payload(dense, buckets, bound)
            return payload, bound.bytes_sent(payload), len(buckets), sent
        groups = {varying_axes(x) for x in anchor}
        payload = self.payload(sizes)
        return payload, (bound.size - 1) * payload, len(groups), sent

    # -- the pieces ----------------------------------------------------------

    def payload(self, sizes) -> int:
        """Bytes one device puts into the all-gather for leaves of ``sizes``
        elements (:func:`payload_bytes` with these settings)."""
        return payload_bytes(
            sizes, chunk_size=self.chunk_size, density=self.density, value_bits=self.value_bits
        )

    def exchange_for(self, sizes, devices: int) -> str:
        """The exchange a fragment of leaves of ``sizes`` elements runs over
        ``devices``: ``exchange``, or under ``"auto"`` :func:`choose_exchange`
        against float32 values scattered densely. The cost model asks here too."""
        if self.exchange != "auto":
            return self.exchange
        return choose_exchange(self.payload(sizes), 4 * sum(sizes), devices)

    def _length(self, x) -> int:
        return leaf_plan(int(np.size(x)), self.chunk_size, self.density)[1]

    def _exchange(self, anchor, bound) -> str:
        return self.exchange_for([int(np.size(x)) for x in anchor], bound.size)

    def _compress(self, x):
        """(positions (chunks, k) int32, codes (chunks, k) uint8, scale (chunks,)
        float32, values (chunks, k) as the receivers decode them) of the ``k``
        largest magnitudes of each chunk of float32 ``x``."""
        n = int(np.size(x))
        chunks, length, k = leaf_plan(n, self.chunk_size, self.density)
        if not n:
            empty = jnp.zeros((0, 0), jnp.float32)
            return empty.astype(jnp.int32), empty.astype(jnp.uint8), jnp.zeros(0), empty
        rows = jnp.pad(jnp.ravel(x), (0, chunks * length - n)).reshape(chunks, length)
        _, where = jax.lax.top_k(jnp.abs(rows), k)
        picked = jnp.take_along_axis(rows, where, axis=1)
        scale = jnp.max(jnp.abs(picked), axis=1)
        levels = 2**self.value_bits - 1
        # Levels (2c - L) * scale / L for codes c = 0..L: a value is off by at
        # most scale / L (docs/diloco.md, "SparseLoCo").
        spacing = scale / levels
        ratio = jnp.where(
            spacing[:, None] > 0, picked / jnp.where(spacing > 0, spacing, 1)[:, None], 0
        )
        codes = jnp.clip(jnp.round((ratio + levels) / 2), 0, levels).astype(jnp.uint8)
        return where, codes, scale, _decode(codes, scale, levels)

    def _gathered_mean(self, picks, acc, bound):
        """Every device's picks, all-gathered as bytes (one collective per set
        of mesh axes the leaves vary over), summed in rank order, over N."""
        levels = 2**self.value_bits - 1
        groups: dict = {}
        for i, x in enumerate(acc):
            groups.setdefault(varying_axes(x), []).append(i)
        mean = [None] * len(acc)
        for key, indices in groups.items():
            blob = jnp.concatenate(
                [_encode(picks[i], self.value_bits) for i in indices if np.size(acc[i])]
                or [jnp.zeros(0, jnp.uint8)]
            )
            axes = bound.reduction.axes
            gathered = bound.all_gather(blob)
            shapes = [
                (jnp.shape(picks[i][0]), jnp.shape(acc[i]), self._length(acc[i])) for i in indices
            ]

            def add(r, sums, gathered=gathered, shapes=shapes):
                row, offset, out = gathered[r], 0, []
                for (pick_shape, shape, length), total in zip(shapes, sums, strict=True):
                    if not math.prod(shape):
                        out.append(total)
                        continue
                    where, codes, scale, offset = _split(row, offset, pick_shape, self.value_bits)
                    values = _decode(codes, scale, levels)
                    out.append(total + _scatter(where, values, shape, length))
                return out

            # Typed as the gathered rows are: over the mesh's other axes
            # (a sharded model's "fsdp") each device adds its own shards.
            others = tuple(a for a in key if a not in axes)
            sums = [jnp.zeros(jnp.shape(acc[i]), jnp.float32) for i in indices]
            sums = [to_varying(x, others) if others else x for x in sums]
            sums = jax.lax.fori_loop(0, gathered.shape[0], add, sums)
            for i, total in zip(indices, sums, strict=True):
                mean[i] = total / gathered.shape[0]
        return mean


def _decode(codes, scale, levels: int):
    """The values of ``codes``: an exact integer level times one rounded spacing."""
    return (2 * codes.astype(jnp.float32) - levels) * (scale / levels)[:, None]


def _scatter(where, values, shape, length: int):
    """``values`` at their positions ``where`` (per chunk of ``length``) in
    float32 zeros of ``shape``."""
    n = math.prod(shape)
    if not n:
        return jnp.zeros(shape, jnp.float32)
    chunks = where.shape[0]
    dense = jnp.zeros((chunks, length), jnp.float32)
    dense = dense.at[jnp.arange(chunks)[:, None], where].set(values, unique_indices=True)
    return dense.reshape(-1)[:n].reshape(shape)


def _encode(pick, value_bits: int):
    """A leaf's picks as bytes: scales, positions (uint16), codes packed."""
    where, codes, scale, _ = pick
    per = 8 // value_bits
    chunks, k = codes.shape
    padded = jnp.pad(codes, ((0, 0), (0, -k % per))).reshape(chunks, -1, per)
    shifts = (value_bits * jnp.arange(per)).astype(jnp.uint8)
    packed = jnp.sum(padded << shifts, axis=2, dtype=jnp.uint8)
    return jnp.concatenate(
        [
            jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(-1),
            jax.lax.bitcast_convert_type(where.astype(jnp.uint16), jnp.uint8).reshape(-1),
            packed.reshape(-1),
        ]
    )


def _split(row, offset: int, pick_shape, value_bits: int):
    """Inverse of :func:`_encode` on ``row[offset:]``: (positions, codes, scale,
    the next offset)."""
    chunks, k = pick_shape
    per = 8 // value_bits
    width = -(-k // per)

    def take(n):
        nonlocal offset
        piece = jax.lax.slice_in_dim(row, offset, offset + n)
        offset += n
        return piece

    scale = jax.lax.bitcast_convert_type(take(SCALE_BYTES * chunks).reshape(chunks, 4), jnp.float32)
    where = jax.lax.bitcast_convert_type(
        take(INDEX_BYTES * chunks * k).reshape(chunks, k, 2), jnp.uint16
    )
    packed = take(chunks * width).reshape(chunks, width, 1)
    shifts = (value_bits * jnp.arange(per)).astype(jnp.uint8)
    codes = ((packed >> shifts) & (2**value_bits - 1)).reshape(chunks, width * per)[:, :k]
    return where.astype(jnp.int32), codes, scale, offset


def sparse_outer(
    *,
    learning_rate: float = 1.0,
    density: float = 0.02,
    chunk_size: int = 4096,
    value_bits: int = 2,
    error_decay: float = 0.95,
    exchange: str = "auto",
) -> SparseOuter:
    """SparseLoCo's outer step, for :func:`jaxcomm.diloco`'s ``outer`` argument.

    At a fragment's sync each device computes ``e <- error_decay * e + (params
    - local)``, sends the ``k`` entries of largest magnitude of every chunk of
    ``e`` with their values quantised to ``value_bits``, and subtracts what it
    sent from ``e``; the update is ``-learning_rate`` times the average of what
    the devices sent. See docs/diloco.md, "SparseLoCo".

    Args:
      learning_rate: the outer learning rate, > 0.
      density: fraction of each chunk sent, in (0, 1]; ``k = max(1,
        floor(density * chunk))``.
      chunk_size: elements per chunk of a leaf (a shorter leaf is one chunk),
        1 to 65536 (positions travel as uint16).
      value_bits: 2, 4 or 8: a value is one of ``2**value_bits`` levels
        spread evenly over ``[-s, s]``, ``s`` the chunk's largest magnitude
        sent (a float32 scale per chunk).
      error_decay: beta in [0, 1], the factor on the unsent error at each sync.
      exchange: ``"all_gather"`` (positions, codes and scales, as bytes),
        ``"dense"`` (an allreduce of the decoded values scattered into the
        fragment, over ``diloco``'s ``wire_dtype``) or ``"auto"``: the one
        sending fewer bytes per device (:func:`choose_exchange`).

    Returns:
      A :class:`SparseOuter`.

    Examples:
      >>> import optax, jaxcomm
      >>> tx = jaxcomm.diloco(optax.adamw(1e-3), jaxcomm.sparse_outer(density=0.02),
      ...                     "data", sync_every=50)
    """
    learning_rate = _validate.check_positive_real("learning_rate", learning_rate)
    density = _validate.check_fraction("density", density, zero=False)
    chunk_size = _validate.check_int("chunk_size", chunk_size, minimum=1)
    if chunk_size > 2**16:
        raise ValueError(f"chunk_size={chunk_size} must be <= 65536: positions travel as uint16")
    if value_bits not in VALUE_BITS or isinstance(value_bits, bool):
        raise ValueError(f"value_bits={value_bits!r} must be one of {VALUE_BITS}")
    error_decay = _validate.check_fraction("error_decay", error_decay, zero=True)
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} must be one of {EXCHANGES}")
    return SparseOuter(learning_rate, density, chunk_size, value_bits, error_decay, exchange)


def sparseloco(
    inner: optax.GradientTransformation,
    axis_name,
    *,
    sync_every: int,
    learning_rate: float = 1.0,
    density: float = 0.02,
    chunk_size: int = 4096,
    value_bits: int = 2,
    error_decay: float = 0.95,
    exchange: str = "auto",
    fragments: int = 1,
    delay: int = 0,
    mixing: float = 0.0,
    wire_dtype=None,
    bucket_bytes: float | None = None,
    algorithm: str = "auto",
    backend: str = "auto",
) -> optax.GradientTransformation:
    """SparseLoCo: :func:`jaxcomm.diloco` with :func:`sparse_outer` as its outer step.

    Used exactly as ``diloco`` (global params in, gradients at
    :func:`jaxcomm.local_params`); its state adds a ``PerDevice`` float32
    error buffer the size of the model, in place of an outer momentum.

    Args:
      inner: the optimizer each device runs on its own gradients.
      axis_name: mesh or pmap axis name(s).
      sync_every: H, as in :func:`jaxcomm.diloco`.
      learning_rate, density, chunk_size, value_bits, error_decay, exchange:
        as in :func:`sparse_outer`.
      fragments, delay, mixing: as in :func:`jaxcomm.diloco`.
      wire_dtype, bucket_bytes, algorithm, backend: of the dense exchange's
        allreduce, as in :func:`jaxcomm.diloco`; the all-gather is the backend's
        (:meth:`jaxcomm.collectives.BoundReduction.all_gather`).

    Returns:
      An ``optax.GradientTransformation`` with :class:`jaxcomm.transforms.diloco.DiLoCoState`.

    Examples:
      >>> import optax, jaxcomm
      >>> tx = jaxcomm.sparseloco(optax.adamw(1e-3), "data", sync_every=50, density=0.02)

    References:
      Sarfi et al., `Communication Efficient LLM Pre-training with SparseLoCo
      <https://arxiv.org/abs/2508.15706>`_, 2025
    """
    outer = sparse_outer(
        learning_rate=learning_rate,
        density=density,
        chunk_size=chunk_size,
        value_bits=value_bits,
        error_decay=error_decay,
        exchange=exchange,
    )
    return diloco(
        inner,
        outer,
        axis_name,
        sync_every=sync_every,
        fragments=fragments,
        delay=delay,
        mixing=mixing,
        wire_dtype=wire_dtype,
        bucket_bytes=bucket_bytes,
        algorithm=algorithm,
        backend=backend,
    )
