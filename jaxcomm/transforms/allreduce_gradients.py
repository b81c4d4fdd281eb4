"""allreduce_gradients: local gradients in, globally reduced gradients out.

One optax transformation with every dense fix: lazy allreduce (fusion into
buckets), FP16/BF16 wire casting with prescaling and optional error
feedback, hierarchical allreduce, and double buffering.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm.collectives import _axes, _checks, _frontend, _xla
from jaxcomm.collectives.allreduce import allreduce
from jaxcomm.transforms import _state
from jaxcomm.transforms._buckets import check_bucket_bytes, plan_buckets

# The ffi default, 4 MiB: big enough that per-collective latency is a small
# part of a bucket's time on Ethernet-class networks (alpha ~ 10-50 us, 4 MiB
# ~ 3 ms at 10 Gbps), small enough that ResNet-50's 100 MB of gradients make
# ~25 buckets, so the first ones can travel while backward still runs. The
# xla backend defaults to one collective per leaf: XLA's all-reduce combiner
# fuses those without copying, where our buckets cost a concatenate and a
# split (bench/overhead.py: 1.03x a per-leaf pmean unfused, 1.78x in 4 MiB
# buckets, ResNet-50 shapes on 8 CPU devices).
DEFAULT_BUCKET_BYTES = 4 * 2**20


class AllReduceGradientsState(NamedTuple):
    """State of :func:`allreduce_gradients`.

    Attributes:
      residual: ``PerDevice`` error-feedback residuals (what the wire cast
        dropped), or ``()`` without error feedback.
      buffer: the reduced gradients of the previous step (double buffering),
        or ``()``.
      stats: :class:`jaxcomm.CommStats` of the last step.
    """

    residual: Any
    buffer: Any
    stats: _state.CommStats


def allreduce_gradients(
    axis_name,
    *,
    op: str = "mean",
    wire_dtype=None,
    error_feedback: bool = False,
    bucket_bytes: float | None = None,
    algorithm: str = "auto",
    backend: str = "auto",
    double_buffering: bool = False,
    check_finite: bool = True,
) -> optax.GradientTransformation:
    """Reduces each device's local gradients over ``axis_name``.

    Put it first in an ``optax.chain``; the optimizer after it sees the
    global gradient, identical on every device. Use inside ``jax.shard_map``
    or ``jax.pmap`` over ``axis_name``, on gradients that are still local to
    each device.

    Leaves are taken in reverse tree order (the order backward produces
    them) and packed greedily into buckets of at least ``bucket_bytes``
    bytes, one collective per bucket; leaves of different dtypes never share
    a bucket.

    Args:
      axis_name: mesh or pmap axis name, or a tuple of them;
        ``(inter_axis, intra_axis)`` for ``algorithm="hierarchical"``.
      op: ``"mean"`` (default) or ``"sum"``.
      wire_dtype: ``None``, ``jnp.float16`` or ``jnp.bfloat16``. Narrow wires
        are prescaled by 1/N before the cast (for ``op="sum"`` too, scaled
        back after), so float16 cannot overflow for large N; where XLA adds
        in float16 (xla ``"auto"`` and ``"hierarchical"``) the prescale is a
        power of two near 1/(2N) instead, as in :func:`jaxcomm.allreduce`.
      error_feedback: keep what the wire cast dropped in a per-device
        residual and add it to the next step's gradient. Needs a narrow wire.
      bucket_bytes: fusion threshold θ. 0: one collective per leaf;
        ``math.inf``: one per dtype. ``None`` (default): 0 with the xla
        backend, whose all-reduce combiner fuses without copies, and
        ``DEFAULT_BUCKET_BYTES`` (4 MiB) with ffi.
      algorithm: ``"auto"``, ``"ring"``, ``"hierarchical"`` or ``"direct"``,
        as in :func:`jaxcomm.allreduce`.
      backend: ``"auto"``, ``"xla"`` or ``"ffi"``, as in :func:`jaxcomm.allreduce`.
      double_buffering: step t returns the reduced gradient of step t-1 (step
        0 returns zeros), so the collective of step t has no consumer inside
        the step and can hide under compute.
      check_finite: look for inf/NaN in the reduced gradient (``stats.nonfinite``).
        It reads the whole gradient once more: on 8 CPU devices sharing 2
        cores that is ~25% of a ResNet-50-shaped step (bench/overhead.py);
        ``False`` skips it and always reports False.

    Returns:
      An ``optax.GradientTransformation``. Its state is an
      :class:`AllReduceGradientsState`; ``jaxcomm.get_stats(state)`` reads
      what the last step sent. A non-finite reduced gradient is returned as
      it is (every device sees the same one) and flagged in the stats, and
      this transform's own state does not take it in; wrap the optimizer
      after it in ``optax.apply_if_finite`` to skip such steps everywhere.

      Options are checked when it is built, without starting JAX's
      backends, so it may be built before ``jax.distributed.initialize``;
      whether ``backend="ffi"`` has its handler is checked when ``update``
      is first traced.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = optax.chain(jaxcomm.allreduce_gradients("data", wire_dtype=jnp.bfloat16),
      ...                  optax.sgd(0.1))
      >>> params = {"w": jnp.ones(4)}
      >>> state = tx.init(params)
      >>> def step(params, state, g):
      ...     updates, state = tx.update({"w": g[0]}, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> g = jnp.arange(4.0 * jax.device_count()).reshape(-1, 4)  # one row per device
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
      ...                             out_specs=(P(), P())))
      >>> g = jax.device_put(g, jax.sharding.NamedSharding(mesh, P("data")))
      >>> new, state = run(params, state, g)
      >>> bool(jnp.allclose(new["w"], 1 - 0.1 * g.mean(0), rtol=1e-2))
      True
      >>> int(jaxcomm.get_stats(state).collectives)
      1
    """
    _checks.check_choice("op", op, _checks.OPS)
    axes = _axes.normalize(axis_name)
    # Only what needs no platform is checked here: looking for the ffi
    # handler makes JAX start its backends, which jax.distributed.initialize
    # must precede, so that waits for the first step.
    _frontend.check_algorithm(algorithm, _frontend.known_backend(backend), axes)
    wire = _checks.check_wire_dtype(wire_dtype)
    if bucket_bytes is not None:
        check_bucket_bytes(bucket_bytes)
    narrow = wire is not None and wire.itemsize < 4
    if error_feedback and not narrow:
        raise ValueError(
            "error_feedback=True keeps what a narrow wire cast drops; "
            f"it needs wire_dtype=float16 or bfloat16, got {None if wire is None else wire.name}"
        )
    reduce_opts = dict(algorithm=algorithm, backend=backend, wire_dtype=wire)

    def init(params):
        rows = _state.devices_on(axes)[0] if error_feedback else 0
        return AllReduceGradientsState(
            residual=_state.per_device_zeros(params, rows) if error_feedback else (),
            buffer=jax.tree.map(jnp.zeros_like, params) if double_buffering else (),
            stats=_state.empty_stats(),
        )

    def update(updates, state, params=None):
        del params
        for i, leaf in enumerate(jax.tree.leaves(updates)):
            _checks.check_input_dtype(f"gradient leaf {i}", jnp.result_type(leaf))
        n = _axes.placement(axes).size
        resolved = _frontend.resolve_backend(backend)
        schedule = _frontend.resolve_algorithm(algorithm, resolved, axes)
        theta = check_bucket_bytes(
            _default_bucket_bytes(resolved) if bucket_bytes is None else bucket_bytes
        )
        grads = updates
        if error_feedback:
            grads = jax.tree.map(jnp.add, grads, _state.local(state.residual))
        leaves, treedef = jax.tree.flatten(grads)
        reduced, payload, count = _reduce_in_buckets(leaves, axes, n, op, theta, reduce_opts)
        reduced = jax.tree.unflatten(treedef, reduced)
        nonfinite = _any_nonfinite(reduced) if check_finite else jnp.bool_(False)

        residual = state.residual
        if error_feedback:
            scale = _wire_scale(wire, n, resolved, schedule)
            dropped = jax.tree.map(lambda v: _cast_error(v, wire, scale), grads)
            # A non-finite step must not poison the residual for good.
            residual = _state.as_row(
                jax.tree.map(
                    lambda new, old: jnp.where(nonfinite, old, new),
                    dropped,
                    _state.local(state.residual),
                )
            )
        if double_buffering:
            out, buffer = state.buffer, reduced
            nonfinite = _any_nonfinite(out) if check_finite else jnp.bool_(False)
        else:
            out, buffer = reduced, state.buffer

        stats = _state.CommStats(
            payload_bytes=jnp.float32(payload),
            bytes_sent=_state.wire_bytes(payload, _axes.sizes(axes), algorithm),
            collectives=jnp.int32(count),
            density=jnp.float32(1),
            nonfinite=nonfinite,
        )
        return out, AllReduceGradientsState(residual, buffer, stats)

    return optax.GradientTransformation(init, update)


def _default_bucket_bytes(backend: str) -> float:
    """bucket_bytes=None for a resolved backend: per leaf on xla, whose
    all-reduce combiner fuses without copies, DEFAULT_BUCKET_BYTES on ffi."""
    return 0 if backend == "xla" else DEFAULT_BUCKET_BYTES


def _reduce_in_buckets(leaves, axes, n, op, theta, opts):
    """One allreduce per bucket of the fusion plan; returns (reduced leaves,
    payload bytes, number of collectives)."""
    wire = opts["wire_dtype"]
    dtypes = [np.dtype(jnp.result_type(leaf)) for leaf in leaves]
    sizes = [int(np.size(leaf)) for leaf in leaves]
    buckets = plan_buckets(
        [s * d.itemsize for s, d in zip(sizes, dtypes, strict=True)], theta, kinds=dtypes
    )
    narrow = wire is not None and wire.itemsize < 4
    # A narrow wire always divides by N before the cast; a sum is scaled back.
    bucket_op = "mean" if narrow else op
    scale_back = n if (narrow and op == "sum") else None

    out = list(leaves)  # zero-size leaves are in no bucket and come back as they are
    payload = 0
    for bucket in buckets:
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in bucket])
        # The bucket is an intermediate of the step: the result may take its buffer.
        red = allreduce(flat, axes, op=bucket_op, in_place=True, **opts)
        if scale_back is not None:
            red = (red.astype(_xla.accumulator(red.dtype)) * scale_back).astype(red.dtype)
        payload += flat.size * (dtypes[bucket[0]] if wire is None else wire).itemsize
        offset = 0
        for i in bucket:
            out[i] = red[offset : offset + sizes[i]].reshape(jnp.shape(leaves[i]))
            offset += sizes[i]
    return out, payload, len(buckets)


def _wire_scale(wire, n: int, backend: str, algorithm: str) -> float:
    """1 / the prescale the collective applies before a narrow wire cast: N,
    or a power of two >= 2N on the paths where XLA adds in float16."""
    if backend == "xla" and algorithm in _xla.ADDS_IN_WIRE:
        return 1.0 / _xla.headroom_scales(wire, n, 1.0 / n, 1.0)[0]
    return n


def _cast_error(v, wire, scale: float):
    """What the wire cast drops from v: v - decast(cast(v / scale)) * scale,
    computed exactly as the collectives cast (scale in the accumulator type)."""
    acc = _xla.accumulator(v.dtype)
    sent = _xla.to_wire(v, wire, 1.0 / scale).astype(acc) * scale
    return (v.astype(acc) - sent).astype(v.dtype)


def _any_nonfinite(tree) -> jax.Array:
    flags = [~jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if np.size(x)]
    return jnp.any(jnp.stack(flags)) if flags else jnp.bool_(False)
