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

from jaxcomm._validate import check_bucket_bytes
from jaxcomm.collectives import reduction
from jaxcomm.transforms import _state
from jaxcomm.transforms._buckets import reduce_in_buckets


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
    """

    residual: Any
    buffer: Any
    stats: _state.CommStats


_state.per_device_fields(AllReduceGradientsState, "residual", "buffer")


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
    each device. ``optax.clip_by_global_norm`` and ``optax.apply_if_finite``
    go after it: before it, clipping uses each device's own norm, and
    ``apply_if_finite`` lets devices disagree on running the collective (JAX
    refuses that under ``shard_map``; under ``pmap`` it hangs on the first
    non-finite step). Inside ``optax.MultiSteps`` the collective still runs on
    every micro-step (docs/compose.md).

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
        ``jnp.float8_e4m3fn`` and ``jnp.float8_e5m2`` (xla backend) scale
        each leaf by a power of two into the format's range and add in
        float32 (:func:`jaxcomm.allreduce` states their error bound).
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
        0 returns zeros). The state's per-device ``buffer`` holds this
        device's gradient of step t-1 (error feedback added), and step t
        reduces it before storing its own: the collective depends on nothing
        the step computes, so it can run under the step's forward and
        backward passes. That needs a backend whose collective does not
        block a compute thread: ``backend="ffi"`` on CPU (its handler
        returns a future; XLA's gloo collectives block); on GPU,
        asynchronous collectives. On ffi/CPU the result is read only once
        the step's gradient exists, so XLA does not lend its memory to the
        forward and backward passes (which would make them wait for the
        collective). Buckets of several leaves are packed from the buffer
        at the start of the step, a copy the forward pass may wait behind:
        ``bucket_bytes=0`` avoids it (bench/README.md). Step 0 reduces the
        zero buffer (a real collective, counted in the stats). The stats and the non-finite
        flag describe the returned gradient. With error feedback the
        residual takes the buffer's cast error one step later, once the
        reduction says whether it was finite, so residuals and results
        equal those without double buffering shifted by one step; a
        checkpoint holds every device's buffer. The buffer is kept in the
        gradient's dtype: its cast error is needed in full precision.
      check_finite: look for inf/NaN in the reduced gradient (``stats.nonfinite``).
        It reads the whole gradient once more: on 8 CPU devices sharing 2
        cores that is ~25% of a ResNet-50-shaped step (bench/overhead.py);
        ``False`` skips it and always reports False.

    Returns:
      An ``optax.GradientTransformation``. Its state is an
      :class:`AllReduceGradientsState`; ``jaxcomm.get_stats(state)`` reads
      what the last step sent. A non-finite reduced gradient is returned as
      it is (every device sees the same one) and flagged in the stats, and
      the error-feedback residual does not take it in; wrap the optimizer
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
    comm = reduction(axis_name, op=op, wire_dtype=wire_dtype, algorithm=algorithm, backend=backend)
    if bucket_bytes is not None:
        check_bucket_bytes(bucket_bytes)
    if error_feedback and not comm.narrow:
        wire = comm.wire_dtype
        raise ValueError(
            "error_feedback=True keeps what a narrow wire cast drops; "
            "it needs a narrow wire_dtype (float16, bfloat16, float8_e4m3fn or float8_e5m2), "
            f"got {None if wire is None else wire.name}"
        )
    # A narrow wire always divides by N before the cast, so float16 cannot
    # overflow; a sum is scaled back by N after.
    scale_back = comm.narrow and op == "sum"
    if comm.narrow:
        comm = comm.with_op("mean")

    def init(params):
        return AllReduceGradientsState(
            residual=_state.per_device_zeros(params, comm) if error_feedback else (),
            buffer=(
                _state.per_device_zeros(params, comm, "double buffer") if double_buffering else ()
            ),
            stats=_state.empty_stats(),
        )

    def update(updates, state, params=None):
        del params
        comm.check_dtypes(updates)
        if error_feedback:
            _state.check_same_tree(updates, _state.local(state.residual), "error-feedback residual")
        if double_buffering:
            _state.check_same_tree(updates, _state.local(state.buffer), "double buffer")
        bound = comm.bind()
        bound.check_local(updates)
        theta = bound.default_bucket_bytes if bucket_bytes is None else bucket_bytes
        residual = _state.local(state.residual) if error_feedback else ()
        if double_buffering:
            # The previous step's local gradient: nothing this step computes
            # feeds the collective, so it can run under the forward and
            # backward passes.
            outgoing = _state.local(state.buffer)
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
        reduced, payload, count = reduce_in_buckets(
            leaves, bound, theta, scale_back=scale_back, in_place=not double_buffering, after=after
        )
        reduced = jax.tree.unflatten(treedef, reduced)
        nonfinite = _state.any_nonfinite(reduced) if check_finite else jnp.bool_(False)

        if error_feedback:
            # What the cast of `outgoing` dropped, unless the reduction came
            # out non-finite: such a step must not poison the residual for good.
            residual = jax.tree.map(
                lambda sent, old: jnp.where(nonfinite, old, bound.cast_error(sent)),
                outgoing,
                residual,
            )
        buffer = state.buffer
        if double_buffering:
            buffer = jax.tree.map(jnp.add, updates, residual) if error_feedback else updates
            buffer = _state.as_row(buffer)
        if error_feedback:
            residual = _state.as_row(residual)

        stats = _state.CommStats(
            payload_bytes=jnp.float32(payload),
            bytes_sent=bound.bytes_sent(payload),
            collectives=jnp.int32(count),
            density=jnp.float32(1),
            nonfinite=nonfinite,
        )
        return reduced, AllReduceGradientsState(residual, buffer, stats)

    return optax.GradientTransformation(init, update)
