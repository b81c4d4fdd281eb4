"""One fragment's step in :func:`jaxcomm.diloco`: the ``lax.cond`` branches.

At a fragment's sync its pseudo-gradient is exchanged (or the exchange
started, where it overlaps the steps until the landing); at its landing the
outer step (an :class:`jaxcomm.transforms.outer_step.OuterStep`) is applied;
and each device's local rows adopt, mix in or keep the new global params.
:func:`fragment` runs one fragment through them; diloco calls it per fragment.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _flat
from jaxcomm.collectives import to_varying, varying_axes
from jaxcomm.state import comm_stats
from jaxcomm.transforms.outer_step import OuterStep


class Schedule(NamedTuple):
    """The checked timing options: H, tau and alpha."""

    sync_every: int
    delay: int
    mixing: float


class Exchange(NamedTuple):
    """How a fragment's sync travels: the bound reduction, the outer step,
    the bucket bytes, and whether the exchange overlaps the steps between."""

    bound: Any
    rule: OuterStep
    theta: float
    started: bool


class Synced(NamedTuple):
    """One fragment's step: its updates and local rows, its new state parts
    (outer state, error buffers, pending, kept) and what it sent."""

    updates: list
    rows: list
    outer: Any
    error: Any
    pending: Any
    kept: Any
    payload: jax.Array
    bytes_sent: jax.Array
    collectives: jax.Array
    elements: jax.Array
    nonfinite: jax.Array


def fragment(anchor, local, carried, *, due, landed, schedule, exchange) -> Synced:
    """One fragment's part of diloco's update: its sync where `due`, its outer
    step where it lands (`landed`, ``None`` without a delay: at the sync),
    and its local rows adopted, mixed or kept.

    `anchor`, `local`: the fragment's global and local leaves; `carried`: its
    (outer state, error buffers, pending, kept) from the state.
    """
    bound, rule, theta, started = exchange
    outer_state, error, pending, kept = carried
    if landed is None:
        # Between syncs neither cond copies. The first passes the outer
        # state through and makes the update's buffers with lax.empty
        # (unwritten on GPU, zeros on CPU; one per dtype, so XLA merges
        # none), zeroed by the where: they cannot be the params', which
        # the caller reads after the cond. The second passes the local
        # rows through; a reshape after it made XLA copy them every step.
        landed = due
        packed, outer_state, error, bad = jax.lax.cond(
            due,
            lambda ops: _sync(ops, bound, rule, theta),
            _skip,
            (anchor, local, outer_state, error),
        )
    else:
        # The collective starts at the sync (or runs there, where it
        # cannot outlive the step); its result lands `delay` steps
        # later. The landing reads the pending value from the sync's
        # cond, not from the state: read by both conds, XLA copied
        # it every step.
        send, land = (_start, _finish) if started else (_send, _land)
        pending, error, kept, bad = jax.lax.cond(
            due,
            lambda ops: send(ops, bound, rule, theta),
            _hold,
            (anchor, local, error, pending, kept),
        )
        packed, outer_state, bad_landing = jax.lax.cond(
            landed,
            lambda ops: land(ops, bound, rule),
            _no_landing,
            (anchor, pending, outer_state, kept),
        )
        bad = bad | bad_landing
    u = [jnp.where(landed, x, jnp.zeros_like(x)) for x in _unpack(packed, anchor)]
    # The very expression the caller's optax.apply_updates builds, so
    # XLA computes it once and the adopted params are the caller's,
    # bitwise. Computed inside the cond instead, XLA fused it into one
    # kernel with the outer step's multiply and it came out 1 ulp away.
    adopted = to_varying(optax.apply_updates(anchor, u), bound.reduction.axes)
    mixing = schedule.mixing
    rows = jax.lax.cond(
        landed,
        _adopt if not mixing else lambda g, x: _mix(g, x, mixing),
        _keep,
        [x[None] for x in adopted],
        [x[None] for x in local],
    )
    payload, on_wire, count, n = rule.cost(anchor, bound, theta)
    return Synced(
        updates=u,
        rows=rows,
        outer=outer_state,
        error=error,
        pending=pending,
        kept=kept,
        payload=jnp.where(due, payload, 0.0),
        bytes_sent=jnp.where(due, on_wire, 0.0),
        collectives=jnp.where(due, count, 0),
        elements=jnp.where(due, n, 0),
        nonfinite=bad,
    )


def _sync(operands, bound, rule, theta):
    """The outer step of one fragment: average params - local, step from params.

    Returns the update packed by :func:`_pack`, the outer state, the error
    buffers and whether the average held an inf or NaN.
    """
    anchor, local, outer_state, error = operands
    mean, error = rule.reduce(anchor, local, error, bound, theta)
    u, outer_state = rule.apply(mean, outer_state, anchor)
    return _pack(u), outer_state, error, comm_stats.any_nonfinite(mean)


def _skip(operands):
    """No sync: buffers for the update left as lax.empty makes them (the
    caller's where reads zeros), the outer state and error buffers as they are."""
    anchor, _, outer_state, error = operands
    return _unwritten(anchor), outer_state, error, jnp.bool_(False)


def _send(operands, bound, rule, theta):
    """A delayed sync: the averaged pseudo-gradient, kept until it lands."""
    anchor, local, error, _, kept = operands
    mean, error = rule.reduce(anchor, local, error, bound, theta)
    return list(mean), error, kept, comm_stats.any_nonfinite(mean)


def _start(operands, bound, rule, theta):
    """A delayed sync that overlaps the steps until it lands: starts the
    average of params - local, one allreduce per :func:`_pack` group, and
    returns their handles (the average's finiteness is known at landing)."""
    del theta  # the dense rule's exchange, in one piece per group
    anchor, local, error, _, _ = operands
    sent, error = rule.outgoing(anchor, local, error, bound)
    started = dict(zip(_groups(sent), map(bound.allreduce_start, _pack(sent)), strict=True))
    # One handle per leaf, its group's: the groups (dtype, axes varied over)
    # are known only here, inside shard_map, and init must shape the state.
    # What was sent is kept too (see _finish).
    return [started[_group(x)] for x in sent], error, sent, jnp.bool_(False)


def _hold(operands):
    """No sync: the pending average (or handles), the error buffers and what
    was sent, as they are."""
    _, _, error, pending, kept = operands
    return list(pending), error, kept, jnp.bool_(False)


def _land(operands, bound, rule):
    """A delayed outer step: the pending average, stepped from params."""
    del bound
    anchor, pending, outer_state, _ = operands
    u, outer_state = rule.apply(pending, outer_state, anchor)
    return _pack(u), outer_state, jnp.bool_(False)


def _finish(operands, bound, rule):
    """A delayed outer step whose exchange was started at the sync: waits for
    the average (done by now unless the link is slower than the steps
    between) and steps from params. Where this job did not start it (a state
    restored between sync and landing), reduces what was sent, kept in the
    state, with the same schedule: the same bits."""
    anchor, handles, outer_state, sent = operands
    first = {}  # each group's handle: that of its first leaf
    for x, h in zip(anchor, handles, strict=True):
        first.setdefault(_group(x), h)
    like = jax.eval_shape(_pack, anchor)
    done = []
    for g, (shape, key) in enumerate(zip(like, _groups(anchor), strict=True)):
        result, found = bound.allreduce_done(first[key], shape, missing_ok=True)
        # What was sent is packed only where it is reduced again: packed
        # outside the cond, every landing would copy it for nothing.
        done.append(
            jax.lax.cond(
                found > 0,
                lambda r, _: r,
                lambda _, kept, g=g: bound.allreduce(_pack(kept)[g]),
                _varying(result, key[1]),
                sent,
            )
        )
    mean = _unpack(done, anchor)
    u, outer_state = rule.apply(mean, outer_state, anchor)
    return _pack(u), outer_state, comm_stats.any_nonfinite(mean)


def _no_landing(operands):
    anchor, _, outer_state, _ = operands
    return _unwritten(anchor), outer_state, jnp.bool_(False)


def initial_pending(parts, delay: int, started: bool) -> tuple:
    """The initial pending values per fragment: the average's leaves, zeros
    replicated like the params (zeros_like keeps their placement), or, where
    the exchange overlaps, an int32[3] handle per leaf (see :func:`_start`)."""
    if not delay:
        return ()
    if started:
        return tuple([jnp.zeros(3, jnp.int32) for _ in part] for part in parts)
    return tuple([jnp.zeros_like(x) for x in part] for part in parts)


def _unwritten(anchor):
    shapes = jax.eval_shape(_pack, anchor)
    return [
        _varying(jax.lax.empty(x.shape, x.dtype), key[1])
        for x, key in zip(shapes, _groups(anchor), strict=True)
    ]


def _group(x) -> tuple:
    """What leaves packed together share: the dtype, and the mesh axes the
    value is typed as varying over (a sharded model's shards differ over
    "fsdp", its replicated leaves do not: packed apart, each keeps its type)."""
    return jnp.result_type(x), varying_axes(x)


def _groups(leaves) -> list:
    return list(dict.fromkeys(_group(x) for x in leaves))


def _varying(x, axes: tuple):
    return to_varying(x, axes) if axes else x


def _pack(leaves):
    """The leaves raveled and concatenated: one flat array per :func:`_group`,
    in the order the groups first appear."""
    groups: dict = {key: [] for key in _groups(leaves)}
    for x in leaves:
        groups[_group(x)].append(jnp.ravel(x))
    return [jnp.concatenate(g) for g in groups.values()]


def _unpack(packed, like):
    """Inverse of :func:`_pack`: leaves shaped and typed as `like`."""
    pieces = {
        key: iter(_flat.split(flat, [jnp.shape(x) for x in like if _group(x) == key]))
        for key, flat in zip(_groups(like), packed, strict=True)
    }
    return [next(pieces[_group(x)]) for x in like]


def _adopt(adopted, local):
    """Sync: every device's local params become the global params."""
    del local
    return adopted


def _mix(adopted, local, mixing: float):
    """Streaming DiLoCo's merge: keep ``mixing`` of the local params."""
    return [
        (mixing * x + (1 - mixing) * g).astype(x.dtype) for g, x in zip(adopted, local, strict=True)
    ]


def _keep(adopted, local):
    """No sync: the local params as the inner step left them."""
    del adopted
    return local
