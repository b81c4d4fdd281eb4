"""diloco: local SGD with an outer optimizer (DiLoCo and Streaming DiLoCo).

Each device trains its own copy of the params with ``inner`` for H steps
without communicating; then the pseudo-gradient (the params of the last sync
minus the local ones) is averaged over devices in one collective, ``outer``
steps the global params from the last sync, and every device restarts from
them (Douillard et al. 2023). With ``fragments=F`` the leaves are cut into F
contiguous groups synchronised in turn, so 1/F of the model travels at each
sync point (Streaming DiLoCo, Douillard et al. 2025).

The params the caller holds are the *global* ones, the same on every device
at every step; each device's local params live in the state (``PerDevice``).
That way the params a device adopts at a sync are bitwise those of every other
device: ``optax.apply_updates(local, global - local)`` would round differently
on each device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _validate
from jaxcomm._sync_schedule import (
    applies,
    check_delay,
    check_sync_schedule,
    plan_fragments,
    sync_offsets,
    syncs,
)
from jaxcomm.collectives import reduction
from jaxcomm.state import comm_stats, per_device
from jaxcomm.transforms import _diloco_sync, _in_shards
from jaxcomm.transforms.outer_step import OuterStep, as_outer_step


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      local: ``LocalParams`` (a ``PerDevice``) params of each device (what its inner steps moved).
      inner: ``PerDevice`` state of the inner optimizer on each device.
      outer: one outer optimizer state per fragment (the same on every
        device), over that fragment's leaves as a list.
      count: int32, steps taken.
      stats: :class:`jaxcomm.CommStats` of the last step.
      pending: with ``delay > 0``, per fragment the averaged pseudo-gradient
        of its last sync (the same on every device), waiting to be applied, or,
        where the exchange overlaps the steps between, the int32[3] handles of
        its allreduces in flight (per leaf, that of the allreduce carrying it;
        the same on every device);
        ``()`` without a delay.
      error: ``PerDevice`` error-feedback buffers, a list per fragment: of a
        sparse outer step (:func:`jaxcomm.sparseloco`), or what a narrow wire
        dropped (``error_feedback=True``); ``()`` otherwise.
      kept: where the exchange overlaps the steps between, ``PerDevice``, a
        list per fragment: what this device sent at the fragment's last sync,
        reduced at the landing in place of a started exchange that this job
        does not have (a state restored mid-delay); ``()`` otherwise.
    """

    local: per_device.LocalParams
    inner: per_device.PerDevice
    outer: tuple
    count: jax.Array
    stats: comm_stats.CommStats
    pending: tuple = ()
    error: per_device.PerDevice = per_device.PerDevice(())
    kept: per_device.PerDevice = per_device.PerDevice(())


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | OuterStep,
    axis_name,
    *,
    sync_every: int,
    fragments: int = 1,
    delay: int = 0,
    mixing: float = 0.0,
    wire_dtype=None,
    error_feedback: bool = False,
    bucket_bytes: float | None = None,
    algorithm: str = "auto",
    backend: str = "auto",
) -> optax.GradientTransformation:
    """Local steps with ``inner``, an averaged outer step every ``sync_every``.

    A whole optimizer (nothing after it in a chain), used inside ``jax.shard_map``
    or ``jax.pmap``. ``params`` are the global params of the last sync, the
    same on every device; take the gradient at this device's own,
    :func:`jaxcomm.local_params` ``(state)``. Every ``H = sync_every`` steps a
    fragment's pseudo-gradient ``params - local`` is averaged over the devices,
    ``outer`` steps ``params`` with it and ``local`` adopts the result (bitwise
    the caller's ``optax.apply_updates``); elsewhere the update is zero. The
    schedule, the overlap and the measured quality: docs/diloco.md.

    Args:
      inner: the optimizer each device runs on its own gradients (state per device).
      outer: an optax optimizer on the averaged pseudo-gradient, e.g.
        ``optax.sgd(1.0)``, one state per fragment; or an ``OuterStep``
        (jaxcomm.transforms.outer_step) such as :func:`jaxcomm.sparse_outer`.
      axis_name: mesh or pmap axis name(s), as in :func:`jaxcomm.allreduce`.
      sync_every: H, inner steps between two syncs of a fragment, >= 1.
      fragments: F, groups of leaves synced in turn ``H/F`` steps apart, 1 <= F <= H.
      delay: tau in [0, H), steps from a fragment's sync to its outer update.
      mixing: alpha in [0, 1), the share of its local params a device keeps then.
      wire_dtype: of the pseudo-gradient, as in :func:`jaxcomm.allreduce`.
      error_feedback: with a narrow wire, resend what its encoding dropped.
      bucket_bytes: fusion threshold, as in :func:`jaxcomm.allreduce_gradients`.
      algorithm, backend: as in :func:`jaxcomm.allreduce`.

    Returns:
      An ``optax.GradientTransformation`` with :class:`DiLoCoState`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = jaxcomm.diloco(optax.sgd(0.1), optax.sgd(1.0), "data", sync_every=4)
      >>> params = {"w": jnp.zeros(3)}
      >>> with jax.set_mesh(mesh):
      ...     state = tx.init(params)
      >>> specs = jaxcomm.state_specs(state, "data")
      >>> def step(params, state, x):
      ...     grads = jax.grad(lambda p: jnp.sum((p["w"] - x[0]) ** 2))(jaxcomm.local_params(state))
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
      ...                             out_specs=(P(), specs)))
      >>> x = jnp.arange(3.0 * jax.device_count()).reshape(-1, 3)  # one row per device
      >>> x = jax.device_put(x, jax.NamedSharding(mesh, P("data")))
      >>> collectives = []
      >>> for _ in range(4):  # one step in flight at a time
      ...     params, state = jax.block_until_ready(run(params, state, x))
      ...     collectives.append(int(jaxcomm.get_stats(state).collectives))
      >>> collectives, bool((state.local.value["w"] == params["w"]).all())  # 4th syncs
      ([0, 0, 0, 1], True)

    References:
      Douillard et al., `DiLoCo: Distributed Low-Communication Training of Language
      Models <https://arxiv.org/abs/2311.08105>`_, 2023

      Douillard et al., `Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch <https://arxiv.org/abs/2501.18512>`_, 2025
    """
    _validate.check_optimizer("inner", inner)
    rule = as_outer_step(outer, error_feedback=error_feedback)
    sync_every, fragments = check_sync_schedule(sync_every, fragments)
    schedule = _diloco_sync.Schedule(
        sync_every, check_delay(delay, sync_every), _check_mixing(mixing)
    )
    delay = schedule.delay
    comm = reduction(
        axis_name,
        op="mean",
        wire_dtype=wire_dtype,
        algorithm=algorithm,
        backend=backend,
        started=bool(delay) and rule.can_start,
    )
    comm.wire.check_error_feedback(error_feedback, encoded=True, given=wire_dtype)

    def overlapped() -> bool:
        # Decided the same way by init and update: the platform's, not the axes'.
        return bool(delay) and rule.can_start and comm.starts_async

    if bucket_bytes is not None:
        bucket_bytes = _validate.check_bucket_bytes(bucket_bytes)
    offsets = sync_offsets(sync_every, fragments)

    def init(params):
        with per_device.declaring(params):  # fragments' leaves keep their specs
            return _init(params)

    def _init(params):
        leaves = jax.tree.leaves(params)
        specs = per_device.declared_specs(params)
        # Planned on the shards update sees (of a model split over other axes).
        sizes = [per_device.shard_size(x, s, comm.axes) for x, s in zip(leaves, specs, strict=True)]
        spans = plan_fragments(sizes, fragments)
        parts = [list(leaves[a:b]) for a, b in spans]
        # Placed like the params: eagerly zeros_like keeps their placement,
        # under jit only a constraint does.
        like = [
            functools.partial(per_device.placed_like, like=part, specs=specs[a:b])
            for part, (a, b) in zip(parts, spans, strict=True)
        ]
        pending = _diloco_sync.initial_pending(parts, delay, overlapped())
        return DiLoCoState(
            local=per_device.LocalParams(per_device.per_device_copies(params, comm).value),
            inner=per_device.per_device_copies(inner.init(params), comm),
            outer=tuple(f(rule.init(part)) for f, part in zip(like, parts, strict=True)),
            count=jnp.int32(0),
            stats=comm_stats.empty_stats(),
            pending=tuple(f(p) for f, p in zip(like, pending, strict=False)),
            error=rule.init_error(parts, comm),
            kept=(
                per_device.per_device_zeros(tuple(list(p) for p in parts), comm, "sent")
                if overlapped()
                else per_device.PerDevice(())
            ),
        )

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(
                "diloco's update needs params: the global params of the last sync, "
                "tx.update(grads, state, params)"
            )
        anchor, treedef = jax.tree.flatten(params)
        comm.check_dtypes(anchor, "param leaf")
        bound = comm.bind()
        _check_local_grads(bound, updates)
        local = per_device.local(state.local)
        step, inner_state = inner.update(updates, per_device.local(state.inner), local)
        local = treedef.flatten_up_to(optax.apply_updates(local, step))

        sizes = [int(np.size(x)) for x in anchor]
        spans = plan_fragments(sizes, fragments)
        theta = bound.default_bucket_bytes if bucket_bytes is None else bucket_bytes
        errors = per_device.local(state.error) if state.error.value else (None,) * len(spans)
        started = overlapped()
        kept = per_device.local(state.kept) if started else (None,) * len(spans)
        pending = state.pending or (None,) * len(spans)
        rows = [None] * len(local)
        done = []
        for f, ((a, b), offset) in enumerate(zip(spans, offsets, strict=True)):
            synced = _diloco_sync.fragment(
                anchor[a:b],
                local[a:b],
                (state.outer[f], errors[f], pending[f], kept[f]),
                due=syncs(state.count, offset, sync_every),
                landed=applies(state.count, offset, sync_every, delay) if delay else None,
                schedule=schedule,
                exchange=_diloco_sync.Exchange(bound, rule, theta, started),
            )
            rows[a:b] = synced.rows
            done.append(synced)

        stats = comm_stats.CommStats(
            payload_bytes=jnp.asarray(sum(d.payload for d in done), jnp.float32),
            bytes_sent=jnp.asarray(sum(d.bytes_sent for d in done), jnp.float32),
            collectives=jnp.asarray(sum(d.collectives for d in done), jnp.int32),
            density=(sum(d.elements for d in done) / max(sum(sizes), 1)).astype(jnp.float32),
            nonfinite=functools.reduce(
                jnp.logical_or, [d.nonfinite for d in done], jnp.bool_(False)
            ),
        )
        new = DiLoCoState(
            # The rows' tree: the params' but with a row axis in any Flax metadata.
            local=per_device.LocalParams(jax.tree.structure(state.local.value).unflatten(rows)),
            inner=per_device.as_row(inner_state, comm.axes),
            outer=tuple(d.outer for d in done),
            count=state.count + 1,
            stats=stats,
            pending=tuple(d.pending for d in done) if delay else (),
            error=(
                per_device.as_row(tuple(d.error for d in done), comm.axes)
                if state.error.value
                else state.error
            ),
            kept=per_device.as_row(tuple(d.kept for d in done), comm.axes)
            if started
            else state.kept,
        )
        return treedef.unflatten([x for d in done for x in d.updates]), new

    return optax.GradientTransformation(init, _in_shards.in_shards(update, comm.axes))


def _check_local_grads(bound, grads) -> None:
    try:
        bound.check_local(grads)
    except ValueError as error:
        raise ValueError(
            "diloco takes each device's own gradient, taken at jaxcomm.local_params(state); "
            f"this one is the same on every device (taken at the global params?): {error}"
        ) from error


def _check_mixing(mixing) -> float:
    if not _validate.is_real(mixing) or not 0 <= mixing < 1:
        raise ValueError(
            f"mixing={mixing!r} must be in [0, 1): the share of its local params a device "
            "keeps when an outer update lands (0 takes the global params)"
        )
    return float(mixing)
