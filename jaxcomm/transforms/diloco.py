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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _validate
from jaxcomm.collectives import reduction, to_varying
from jaxcomm.transforms import _state
from jaxcomm.transforms._buckets import buckets_payload, leaf_buckets, reduce_in_buckets


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      local: ``PerDevice`` params of each device (what its inner steps moved).
      inner: ``PerDevice`` state of the inner optimizer on each device.
      outer: one outer optimizer state per fragment (the same on every
        device), over that fragment's leaves as a list.
      count: int32, steps taken.
      stats: :class:`jaxcomm.CommStats` of the last step.
    """

    local: _state.PerDevice
    inner: _state.PerDevice
    outer: tuple
    count: jax.Array
    stats: _state.CommStats


_state.per_device_fields(DiLoCoState, "local", "inner")


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    axis_name,
    *,
    sync_every: int,
    fragments: int = 1,
    wire_dtype=None,
    bucket_bytes: float | None = None,
    algorithm: str = "auto",
    backend: str = "auto",
) -> optax.GradientTransformation:
    """Local steps with ``inner``, an averaged outer step every ``sync_every``.

    Use inside ``jax.shard_map`` or ``jax.pmap`` over ``axis_name``. Unlike
    the other transforms, the gradient must be taken at *this device's* params,
    :func:`jaxcomm.local_params` ``(state)``, while ``params`` (passed to
    ``update`` and updated with ``optax.apply_updates``) are the global params
    of the last sync, identical on every device. It is a whole optimizer: put
    nothing after it in a chain, since its updates must reach ``params`` as
    they are (the local params adopt ``params + update`` at a sync). Each
    step (count ``s`` from 0):

    1. ``local <- local + inner.update(grads)``, on this device only.
    2. For each fragment ``f`` due at ``s`` (see below): ``delta`` = mean over
       devices of ``params - local`` on the fragment's leaves (fused into
       buckets as in :func:`jaxcomm.allreduce_gradients`, on the wire
       ``wire_dtype``); ``u = outer.update(delta)``;
       the returned update is ``u`` on these leaves, and every device's local
       params take ``optax.apply_updates(params, u)``, bitwise what the caller
       gets. Fragments not due return a zero update.

    Fragments: the leaves, in tree order, are cut into ``fragments``
    contiguous groups; the cut after group ``k`` falls at the leaf boundary
    nearest to ``k/F`` of all elements (ties to the earlier boundary), every
    group keeping at least one leaf. Fragment ``f`` is due at step ``s`` when
    ``(s + 1) % H == ((f + 1) * H // F) % H``, with ``H = sync_every``: the
    fragments go in order, ``H/F`` steps apart, each every ``H`` steps (its
    first sync comes after ``(f + 1) * H // F`` steps). ``fragments=1`` is
    DiLoCo: everything at ``s + 1 = H, 2H, ...``. Each fragment has its own
    outer state. The fragment's collective runs inside its sync step and is
    used at once (no overlap with the next inner steps).

    Sync steps run under ``lax.cond`` on the step count, which every device
    holds the same, so all devices enter the same branch, and steps with no
    fragment due issue no collective at all.

    Args:
      inner: the optimizer each device runs on its own gradients, e.g.
        ``optax.adamw(...)``; its state is per device and is kept across syncs.
      outer: the optimizer on the averaged pseudo-gradient, e.g.
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      axis_name: mesh or pmap axis name(s), as in :func:`jaxcomm.allreduce`.
      sync_every: H, inner steps between two syncs of a fragment, >= 1.
      fragments: F, the number of fragments, 1 <= F <= H and at most the
        number of leaves (checked at ``init``).
      wire_dtype: ``None``, ``jnp.float16`` or ``jnp.bfloat16`` for the
        pseudo-gradient (prescaled as in :func:`jaxcomm.allreduce`).
      bucket_bytes: fusion threshold within a fragment, as in
        :func:`jaxcomm.allreduce_gradients`: ``None`` (default) is one
        collective per leaf on xla (XLA's combiner fuses them) and 4 MiB
        buckets on ffi; ``math.inf`` one collective per dtype.
      algorithm: as in :func:`jaxcomm.allreduce`.
      backend: ``"auto"``, ``"xla"`` or ``"ffi"``, as in :func:`jaxcomm.allreduce`.

    Returns:
      An ``optax.GradientTransformation`` with :class:`DiLoCoState`. Its
      per-device parts are ``PerDevice`` subtrees: place the state with
      :func:`jaxcomm.state_specs`; init needs the axis size (call it inside
      ``shard_map`` or under ``jax.set_mesh``). ``jaxcomm.get_stats`` reads
      what the last step sent: zeros between syncs, ``density`` the fraction
      of the model's elements sent. ``stats.nonfinite`` flags a non-finite
      averaged pseudo-gradient; the step is taken all the same.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = jaxcomm.diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True),
      ...                     "data", sync_every=4)
      >>> params = {"w": jnp.zeros(3)}
      >>> with jax.set_mesh(mesh):
      ...     state = tx.init(params)
      >>> specs = jaxcomm.state_specs(state, "data")
      >>> def loss(p, x):
      ...     return jnp.sum((p["w"] - x) ** 2)
      >>> def step(params, state, x):
      ...     grads = jax.grad(loss)(jaxcomm.local_params(state), x[0])
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
      ...                             out_specs=(P(), specs)))
      >>> state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
      >>> x = jnp.arange(3.0 * jax.device_count()).reshape(-1, 3)  # one row per device
      >>> x = jax.device_put(x, NamedSharding(mesh, P("data")))
      >>> collectives = []
      >>> for _ in range(4):  # one step in flight at a time
      ...     params, state = jax.block_until_ready(run(params, state, x))
      ...     collectives.append(int(jaxcomm.get_stats(state).collectives))
      >>> collectives  # only the 4th step syncs
      [0, 0, 0, 1]
      >>> bool((state.local.value["w"] == params["w"]).all())  # every device adopted them
      True
    """
    _check_optimizer("inner", inner)
    _check_optimizer("outer", outer)
    sync_every, fragments = check_sync_schedule(sync_every, fragments)
    comm = reduction(
        axis_name, op="mean", wire_dtype=wire_dtype, algorithm=algorithm, backend=backend
    )
    if bucket_bytes is not None:
        bucket_bytes = _validate.check_bucket_bytes(bucket_bytes)
    offsets = sync_offsets(sync_every, fragments)

    def init(params):
        leaves = jax.tree.leaves(params)
        spans = plan_fragments([int(np.size(x)) for x in leaves], fragments)
        return DiLoCoState(
            local=_state.per_device_copies(params, comm),
            inner=_state.per_device_copies(inner.init(params), comm),
            outer=tuple(outer.init(list(leaves[a:b])) for a, b in spans),
            count=jnp.int32(0),
            stats=_state.empty_stats(),
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
        local = _state.local(state.local)
        step, inner_state = inner.update(updates, _state.local(state.inner), local)
        local = treedef.flatten_up_to(optax.apply_updates(local, step))

        sizes = [int(np.size(x)) for x in anchor]
        spans = plan_fragments(sizes, fragments)
        theta = bound.default_bucket_bytes if bucket_bytes is None else bucket_bytes
        phase = (state.count + 1) % sync_every
        out, outer_states, sent, elements, collectives = [], [], [], [], []
        rows = [None] * len(local)
        nonfinite = jnp.bool_(False)
        for (a, b), offset, outer_state in zip(spans, offsets, state.outer, strict=True):
            due = phase == offset
            # Between syncs neither cond copies. The first passes the outer
            # state through and makes the update's buffers with lax.empty
            # (unwritten on GPU, zeros on CPU; one per dtype, so XLA merges
            # none), zeroed by the where: they cannot be the params', which
            # the caller reads after the cond. The second passes the local
            # rows through; a reshape after it made XLA copy them every step.
            packed, outer_state, bad = jax.lax.cond(
                due,
                lambda ops: _sync(ops, bound, outer, theta),
                _skip,
                (anchor[a:b], local[a:b], outer_state),
            )
            unpacked = _unpack(packed, anchor[a:b])
            u = [jnp.where(due, x, jnp.zeros_like(x)) for x in unpacked]
            out += u
            # The very expression the caller's optax.apply_updates builds, so
            # XLA computes it once and the adopted params are the caller's,
            # bitwise. Computed inside the cond instead, XLA fused it into one
            # kernel with the outer step's multiply and it came out 1 ulp away.
            adopted = to_varying(optax.apply_updates(anchor[a:b], u), comm.axes)
            rows[a:b] = jax.lax.cond(
                due, _adopt, _keep, [x[None] for x in adopted], [x[None] for x in local[a:b]]
            )
            outer_states.append(outer_state)
            buckets = leaf_buckets(anchor[a:b], theta)
            payload, count = buckets_payload(anchor[a:b], buckets, bound), len(buckets)
            sent.append(jnp.where(due, payload, 0.0))
            collectives.append(jnp.where(due, count, 0))
            elements.append(jnp.where(due, sum(sizes[a:b]), 0))
            nonfinite = nonfinite | bad

        payload = sum(sent)
        stats = _state.CommStats(
            payload_bytes=jnp.asarray(payload, jnp.float32),
            bytes_sent=bound.bytes_sent(payload),
            collectives=jnp.asarray(sum(collectives), jnp.int32),
            density=(sum(elements) / max(sum(sizes), 1)).astype(jnp.float32),
            nonfinite=nonfinite,
        )
        new = DiLoCoState(
            local=_state.PerDevice(treedef.unflatten(rows)),
            inner=_state.as_row(inner_state),
            outer=tuple(outer_states),
            count=state.count + 1,
            stats=stats,
        )
        return treedef.unflatten(out), new

    return optax.GradientTransformation(init, update)


def local_params(opt_state, like=None):
    """This device's params in the state of a :func:`diloco` (inside ``shard_map``).

    Take the gradient at these: they are what this device's inner steps
    moved since the last sync. Works on the state of an ``optax.chain`` or any
    nesting of it, like :func:`jaxcomm.get_stats`, and on a Flax
    ``nnx.Optimizer``'s ``opt_state``. Outside ``shard_map``,
    ``state.local.value`` holds every device's params, one row per device.

    Args:
      opt_state: the optimizer state holding one diloco state.
      like: optional tree with the params' structure (for Flax NNX,
        ``nnx.state(model, nnx.Param)``); the values come back in it, so
        ``nnx.merge`` takes them as the model's params.
    """
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState))
        if isinstance(s, DiLoCoState)
    ]
    if len(found) != 1:
        raise ValueError(f"expected one diloco state in the state, found {len(found)}")
    rows = {jnp.shape(x)[0] for x in jax.tree.leaves(found[0].local.value)}
    if rows - {1}:
        raise ValueError(
            f"local_params reads this device's row, but the state holds {max(rows)} rows: "
            "call it inside jax.shard_map / jax.pmap, where each device sees its own"
        )
    local = _state.local(found[0].local)
    if like is None:
        return local
    values, want = jax.tree.leaves(local), jax.tree.structure(like)
    if len(values) != want.num_leaves:
        raise ValueError(
            f"local_params: like has {want.num_leaves} leaves but the diloco state holds "
            f"{len(values)} params"
        )
    for (path, leaf), value in zip(jax.tree_util.tree_leaves_with_path(like), values, strict=True):
        if jnp.shape(leaf) != jnp.shape(value):
            raise ValueError(
                f"local_params: like{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)} "
                f"but the diloco state's param there has {jnp.shape(value)}"
            )
    return jax.tree.unflatten(want, values)


def plan_fragments(sizes, fragments: int) -> tuple[tuple[int, int], ...]:
    """Cuts leaves (their element counts, in tree order) into contiguous fragments.

    The cut after fragment ``k`` is the leaf boundary whose element count so
    far is nearest to ``k/F`` of the total (ties to the earlier boundary),
    leaving at least one leaf to each fragment.

    Returns:
      ``(start, stop)`` leaf indices of each fragment.

    Examples:
      >>> plan_fragments([1, 5, 8, 7], 2)
      ((0, 3), (3, 4))
      >>> plan_fragments([4, 4, 4, 4], 4)
      ((0, 1), (1, 2), (2, 3), (3, 4))
    """
    n = len(sizes)
    if fragments > n:
        raise ValueError(f"fragments={fragments} needs at least that many leaves; params have {n}")
    bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    total = int(bounds[-1])
    cuts = [0]
    for k in range(1, fragments):
        candidates = range(cuts[-1] + 1, n - (fragments - k) + 1)
        # Compared as k*total vs F*bound, in integers: no float ties.
        cuts.append(min(candidates, key=lambda i: abs(fragments * int(bounds[i]) - k * total)))
    cuts.append(n)
    return tuple(zip(cuts[:-1], cuts[1:], strict=True))


def check_sync_schedule(sync_every, fragments) -> tuple[int, int]:
    """``sync_every`` (H) and ``fragments`` (F) as ints, if 1 <= F <= H.

    Each fragment syncs at its own step of the H-step cycle, so there can be
    no more fragments than steps. The cost model checks its settings here too.

    Examples:
      >>> check_sync_schedule(50, 5)
      (50, 5)
      >>> check_sync_schedule(2, 3)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: fragments=3 must be <= sync_every=2: each fragment syncs at ...
    """
    sync_every = _validate.check_positive_integer("sync_every", sync_every)
    fragments = _validate.check_positive_integer("fragments", fragments)
    if fragments > sync_every:
        raise ValueError(
            f"fragments={fragments} must be <= sync_every={sync_every}: each fragment "
            "syncs at its own step of the cycle"
        )
    return sync_every, fragments


def sync_offsets(sync_every: int, fragments: int) -> tuple[int, ...]:
    """Fragment f syncs after step s (from 0) when ``(s + 1) % sync_every`` is its offset.

    Examples:
      >>> sync_offsets(4, 1), sync_offsets(6, 3), sync_offsets(5, 2)
      ((0,), (2, 4, 0), (2, 0))
    """
    return tuple(((f + 1) * sync_every // fragments) % sync_every for f in range(fragments))


def _sync(operands, bound, outer, theta):
    """The outer step of one fragment: average params - local, step from params.

    Returns the update packed by :func:`_pack`, the outer state and whether
    the average held an inf or NaN.
    """
    anchor, local, outer_state = operands
    delta = [g - x for g, x in zip(anchor, local, strict=True)]
    mean = reduce_in_buckets(delta, bound, theta)[0]
    u, outer_state = outer.update(mean, outer_state, anchor)
    return _pack(u), outer_state, _state.any_nonfinite(mean)


def _skip(operands):
    """No sync: buffers for the update left as lax.empty makes them (the
    caller's where reads zeros), and the outer state as it is."""
    anchor, _, outer_state = operands
    unwritten = [jax.lax.empty(x.shape, x.dtype) for x in jax.eval_shape(_pack, anchor)]
    return unwritten, outer_state, jnp.bool_(False)


def _pack(leaves):
    """The leaves raveled and concatenated: one flat array per dtype, in the
    order the dtypes first appear."""
    groups: dict = {}
    for x in leaves:
        groups.setdefault(jnp.result_type(x), []).append(jnp.ravel(x))
    return [jnp.concatenate(g) for g in groups.values()]


def _unpack(packed, like):
    """Inverse of :func:`_pack`: leaves shaped and typed as `like`."""
    flats = dict(zip(dict.fromkeys(jnp.result_type(x) for x in like), packed, strict=True))
    offsets = dict.fromkeys(flats, 0)
    out = []
    for x in like:
        dtype, n = jnp.result_type(x), int(np.size(x))
        out.append(flats[dtype][offsets[dtype] : offsets[dtype] + n].reshape(jnp.shape(x)))
        offsets[dtype] += n
    return out


def _adopt(adopted, local):
    """Sync: every device's local params become the global params."""
    del local
    return adopted


def _keep(adopted, local):
    """No sync: the local params as the inner step left them."""
    del adopted
    return local


def _check_local_grads(bound, grads) -> None:
    try:
        bound.check_local(grads)
    except ValueError as error:
        raise ValueError(
            "diloco takes each device's own gradient, taken at jaxcomm.local_params(state); "
            f"this one is the same on every device (taken at the global params?): {error}"
        ) from error


def _check_optimizer(name: str, tx: Any) -> None:
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{name}={tx!r} must be an optax.GradientTransformation, e.g. optax.sgd(0.1)"
        )
