"""allreduce_gradients: local gradients in, globally reduced gradients out.

One optax transformation with every dense fix: lazy allreduce (fusion into
buckets), FP16/BF16 wire casting with prescaling and optional error
feedback, hierarchical allreduce, and double buffering.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate
from jaxcomm._validate import check_bucket_bytes
from jaxcomm.collectives import reduction
from jaxcomm.state import comm_stats, per_device
from jaxcomm.transforms import _in_shards
from jaxcomm.transforms._buckets import finish_in_buckets, reduce_in_buckets, start_in_buckets


class AllReduceGradientsState(NamedTuple):
    """State of :func:`allreduce_gradients`.

    Attributes:
      residual: ``PerDevice`` error-feedback residuals (what the wire cast
        dropped), or ``()`` without error feedback. With double buffering,
        the residual that went into ``buffer``: the buffer's own cast error
        joins it at the next step (see ``double_buffering``).
      buffer: ``PerDevice`` double buffer: this device's local gradient of
        the previous step, error feedback added (what the next step
        reduces), or ``()``.
      stats: :class:`jaxcomm.CommStats` of the last step.
      handles: where the double buffer's exchange is started at the end of a
        step and finished in the next (jaxcomm's CPU transport, across
        processes), one int32[3] handle per leaf, its bucket's; else ``()``.
    """

    residual: Any
    buffer: Any
    stats: comm_stats.CommStats
    handles: Any = ()


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

    Put it first in an ``optax.chain``, inside ``jax.shard_map`` or ``jax.pmap``:
    the optimizer after it sees the global gradient, the same on every device
    (clipping and ``optax.apply_if_finite`` go after it: docs/compose.md). Each
    step, with ``cast`` the round trip through the wire, ``s`` its prescale and
    ``e_i`` device i's error-feedback residual (docs/design.md, "The techniques")::

      out = sum_i cast(s * v_i) / (s * N),  v_i = g_i + e_i   (op="sum": N * out)
      e_i <- v_i - cast(s * v_i) / s

    Leaves go in reverse tree order into buckets of ``bucket_bytes`` or more, one
    dtype and one collective per bucket.

    Args:
      axis_name: mesh or pmap axis name, or a tuple of them;
        ``(inter_axis, intra_axis)`` for ``algorithm="hierarchical"``.
      op: ``"mean"`` (default) or ``"sum"``.
      wire_dtype: ``None`` (the gradient's dtype), ``jnp.float16``, ``jnp.bfloat16``,
        ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``, ``"int8"`` or ``"int4"`` (the last
        four xla only); prescaled for ``op="sum"`` too, so float16 cannot overflow
        (docs/design.md).
      error_feedback: add what the wire cast dropped (``e_i``, kept per device) to
        the next step's gradient. Needs a narrow wire, else ValueError.
      bucket_bytes: fusion threshold θ; 0 is one collective per leaf, ``math.inf``
        one per dtype. ``None``: 0 on xla, ``DEFAULT_BUCKET_BYTES`` (4 MiB) on ffi.
      algorithm, backend: as in :func:`jaxcomm.allreduce`.
      double_buffering: step t returns the reduced gradient of step t-1 (zeros at
        step 0). On CPU across processes (where ``"auto"`` picks ffi) step t-1
        starts that exchange as it ends and step t finishes it, so it travels
        between the steps; else it runs under step t's forward and backward passes.
        The stale step costs quality (docs/double_buffering.md):
        :func:`jaxcomm.double_buffered` overlaps the same exchange without it.
      check_finite: set ``stats.nonfinite`` if the reduced gradient holds an inf or
        NaN, at the cost of one more read of it; ``False`` always reports False.

    Returns:
      An ``optax.GradientTransformation`` with :class:`AllReduceGradientsState`. A
      non-finite result is returned as it is on every device, flagged and kept out
      of the residual: put the optimizer after it in ``optax.apply_if_finite``.

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
    comm = reduction(
        axis_name,
        op=op,
        wire_dtype=wire_dtype,
        algorithm=algorithm,
        backend=backend,
        started=double_buffering,
    )
    if bucket_bytes is not None:
        check_bucket_bytes(bucket_bytes)
    comm.wire.check_error_feedback(error_feedback)
    scale_back = comm.wire.scales_back(op)
    comm = comm.with_op(comm.wire.collective_op(op))

    def started() -> bool:
        return double_buffering and comm.starts_between_steps

    def init(params):
        return AllReduceGradientsState(
            residual=per_device.per_device_zeros(params, comm) if error_feedback else (),
            buffer=(
                per_device.per_device_zeros(params, comm, "double buffer")
                if double_buffering
                else ()
            ),
            stats=comm_stats.empty_stats(),
            # Zeros name no exchange: the first step reduces the zero buffer.
            handles=[jnp.zeros(3, jnp.int32) for _ in jax.tree.leaves(params)] if started() else (),
        )

    def update(updates, state, params=None):
        del params
        comm.check_dtypes(updates)
        if error_feedback:
            _validate.check_same_tree(
                updates, per_device.local(state.residual), "error-feedback residual"
            )
        if double_buffering:
            _validate.check_same_tree(updates, per_device.local(state.buffer), "double buffer")
        bound = comm.bind()
        bound.check_local(updates)
        theta = bound.default_bucket_bytes if bucket_bytes is None else bucket_bytes
        residual = per_device.local(state.residual) if error_feedback else ()
        if double_buffering:
            # The previous step's local gradient: nothing this step computes
            # feeds the collective, so it can run under the forward and
            # backward passes.
            outgoing = per_device.local(state.buffer)
        else:
            outgoing = jax.tree.map(jnp.add, updates, residual) if error_feedback else updates
        leaves, treedef = jax.tree.flatten(outgoing)
        after = ()
        if double_buffering:
            # The result is applied after this step's backward pass; read
            # earlier, its memory would be lent to the forward and backward
            # passes, and they would wait for the collective.
            after = [bound.after(jnp.zeros((), jnp.int32), jax.tree.leaves(updates))]
        # The buffer is a parameter of the step: reducing it in place would
        # copy it first, and the call would wait for the copy.
        if started():
            # Started at the end of the previous step: it travelled while
            # this step computed.
            reduced, payload, count = finish_in_buckets(
                state.handles, leaves, bound, theta, scale_back=scale_back, after=after
            )
        else:
            reduced, payload, count = reduce_in_buckets(
                leaves,
                bound,
                theta,
                scale_back=scale_back,
                in_place=not double_buffering,
                after=after,
            )
        reduced = jax.tree.unflatten(treedef, reduced)
        nonfinite = comm_stats.any_nonfinite(reduced) if check_finite else jnp.bool_(False)

        if error_feedback:
            # What the cast of `outgoing` dropped, unless the reduction came
            # out non-finite: such a step must not poison the residual for good.
            residual = jax.tree.map(
                lambda sent, old: jnp.where(nonfinite, old, bound.cast_error(sent)),
                outgoing,
                residual,
            )
        buffer, handles = state.buffer, state.handles
        if double_buffering:
            buffer = jax.tree.map(jnp.add, updates, residual) if error_feedback else updates
            if started():
                # The next step's exchange leaves now, and is kept too, for a
                # job that restores this state without the exchange in flight.
                handles = start_in_buckets(jax.tree.leaves(buffer), bound, theta)
            buffer = per_device.as_row(buffer, comm.axes)
        if error_feedback:
            residual = per_device.as_row(residual, comm.axes)

        stats = comm_stats.CommStats(
            payload_bytes=jnp.float32(payload),
            bytes_sent=bound.bytes_sent(payload),
            collectives=jnp.int32(count),
            density=jnp.float32(1),
            nonfinite=nonfinite,
        )
        return reduced, AllReduceGradientsState(residual, buffer, stats, handles)

    return optax.GradientTransformation(init, _in_shards.in_shards(update, comm.axes))
