"""What the transforms keep between steps: shared state, per-device state, stats.

Most of a transform's state is the same on every device (reduced gradients,
chunk masks, counters). Residuals are not: they hold what *this* device has
not sent yet. Such leaves are wrapped in :class:`PerDevice` and carry a
leading axis with one row per device, so that under ``shard_map`` they are
ordinary arrays sharded over the reduction axes (see :func:`state_specs`),
and a checkpoint holds every device's residual.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives import Reduction


class PerDevice(NamedTuple):
    """A subtree whose leaves differ per device; each has a leading device axis."""

    value: Any


# The fields of each jaxcomm state that hold PerDevice subtrees, by the
# state's field names: Flax NNX state keeps the names but not the types.
_PER_DEVICE_FIELDS: dict[frozenset, tuple[str, ...]] = {}


def per_device_fields(state_type, *fields: str) -> None:
    """Records that ``fields`` of the NamedTuple ``state_type`` (a jaxcomm
    transform's state) are :class:`PerDevice`, for :func:`state_specs` on
    containers that dropped the type."""
    _PER_DEVICE_FIELDS[frozenset(state_type._fields)] = fields


class CommStats(NamedTuple):
    """What one step communicated, as seen by this device; log it freely.

    Attributes:
      payload_bytes: bytes this device put into its collectives (elements x
        wire itemsize), summed over them.
      bytes_sent: bytes this device sends on the wire under a
        bandwidth-optimal schedule: 2(N-1)/N x payload for a flat allreduce,
        2(L-1)/L x payload + 2(M-1)/M x payload/L for hierarchical (the
        nccl-tests busbw convention; exact for the ring when N divides the
        size).
      collectives: number of allreduce calls this step.
      density: fraction of the gradient exchanged (1 for dense).
      nonfinite: the reduced gradient held an inf or NaN.
    """

    payload_bytes: jax.Array
    bytes_sent: jax.Array
    collectives: jax.Array
    density: jax.Array
    nonfinite: jax.Array


def empty_stats() -> CommStats:
    return CommStats(
        payload_bytes=jnp.float32(0),
        bytes_sent=jnp.float32(0),
        collectives=jnp.int32(0),
        density=jnp.float32(1),
        nonfinite=jnp.bool_(False),
    )


def any_nonfinite(tree) -> jax.Array:
    """Whether any leaf of `tree` holds an inf or NaN (False for no elements).

    Where the leaves are shards of a model sharded over other mesh axes, the
    flag is combined over those axes (one scalar each way), so every device
    skips the same steps."""
    flags = [~jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.size(x)]
    if not flags:
        return jnp.bool_(False)
    return agreed_any(jnp.any(jnp.stack(flags)))


def varying_axes(x) -> tuple:
    """The mesh axes `x` is typed as varying over (inside shard_map with
    check_vma), sorted; () elsewhere."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return tuple(sorted(mat.varying)) if mat is not None else ()


def agreed_mean(x, over: tuple) -> jax.Array:
    """`x` (a float scalar) averaged over the axes of `over` it is typed as
    varying over (inside shard_map): the shards of a sharded model (`over`,
    "fsdp"), whose stats differ shard by shard, report one value."""
    varying = tuple(a for a in varying_axes(x) if a in over)
    return jax.lax.pmean(x, varying) if varying else x


def agreed_any(flag) -> jax.Array:
    """`flag` (a bool scalar), true on every device where it is true on one
    of the devices it is typed as varying over (inside shard_map)."""
    varying = varying_axes(flag)
    if not varying:
        return flag
    return jax.lax.pmax(flag.astype(jnp.int32), varying) > 0


def get_stats(opt_state) -> CommStats:
    """The :class:`CommStats` of the (only) jaxcomm transform in ``opt_state``.

    Works on the state of an ``optax.chain`` or any nesting of it, and on
    Flax NNX state (``nnx.state(optimizer)``, ``optimizer.opt_state``), whose
    variables it unwraps: the fields are plain arrays.
    """
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, CommStats))
        if isinstance(s, CommStats)
    ]
    if not found:
        found = _stats_by_name(opt_state)
    if len(found) != 1:
        raise ValueError(f"expected one jaxcomm transform's stats in the state, found {len(found)}")
    # A container (nnx.Variable) around each field is a pytree node over its array.
    return CommStats(*(_unwrap(field) for field in found[0]))


def _unwrap(field):
    leaves = jax.tree.leaves(field)
    return leaves[0] if len(leaves) == 1 else field


def _names(path) -> tuple:
    """A key path as plain names: nnx.State turns a NamedTuple's fields
    (GetAttrKey) into dict keys (DictKey), so only the names compare."""
    return tuple(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _jaxcomm_prefixes(tree) -> list[tuple]:
    """Where a jaxcomm state sits in a container that dropped its types
    (nnx.state(optimizer) holds nested dicts): every path with a ``stats``
    entry holding exactly the fields of CommStats."""
    fields: dict[tuple, set] = {}
    for path, _ in _with_path(tree):
        names = _names(path)
        for i, name in enumerate(names[:-1]):
            if name == "stats" and names[i + 1] in CommStats._fields:
                fields.setdefault(names[:i], set()).add(names[i + 1])
    return [p for p, f in fields.items() if f == set(CommStats._fields)]


def _registered_prefixes(tree) -> list[tuple]:
    """Where a jaxcomm state without stats of its own (accumulate's) sits in a
    container that dropped its types: paths whose entries are exactly the
    fields of a registered state."""
    children: dict[tuple, set] = {}
    for path, _ in _with_path(tree):
        names = _names(path)
        for i in range(len(names)):
            children.setdefault(names[:i], set()).add(names[i])
    return [p for p, c in children.items() if frozenset(c) in _PER_DEVICE_FIELDS]


def _stats_by_name(tree) -> list[CommStats]:
    found = []
    for prefix in _jaxcomm_prefixes(tree):
        leaves = {}
        for path, x in _with_path(tree):
            names = _names(path)
            if names[: len(prefix) + 1] == (*prefix, "stats"):
                leaves[names[len(prefix) + 1]] = x
        found.append(CommStats(**leaves))
    return found


def devices_on(comm: Reduction, what: str = "residual") -> tuple[int, bool]:
    """(rows a PerDevice leaf gets at init, whether `comm`'s axes are bound here).

    Inside shard_map or pmap each device builds its own row; outside, the
    active mesh (``jax.set_mesh``) says how many devices there are. `what`
    names the per-device state in the error raised without either.
    """
    axes = comm.axes
    if comm.is_bound():
        return 1, True
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    missing = [a for a in axes if a not in sizes]
    if sizes:  # under set_mesh, shard_map or pmap (whose axes make a mesh too)
        comm.check_bound(mesh=True)
    if missing:
        raise ValueError(
            f"this transform keeps a per-device {what}, so init needs the size of axes "
            f"{missing}: call init inside jax.shard_map / jax.pmap, or under "
            "`with jax.set_mesh(mesh):`"
        )
    return math.prod(sizes[a] for a in axes), False


def check_same_tree(updates, reference, what: str, argument: str = "gradient") -> None:
    """Raises ValueError naming the first path where the gradient tree and
    `reference` (a tree the state was built with) differ in leaves or shapes."""
    got = {jax.tree_util.keystr(p): jnp.shape(x) for p, x in _with_path(updates)}
    want = {jax.tree_util.keystr(p): jnp.shape(x) for p, x in _with_path(reference)}
    if got == want:
        return
    hint = "the gradient's tree must be that of the params the optimizer state was built for"
    for path, shape in want.items():
        if path not in got:
            raise ValueError(f"{argument}{path} is missing: {hint}")
        if got[path] != shape:
            raise ValueError(
                f"{argument}{path} has shape {got[path]} but the {what} holds {shape} there: {hint}"
            )
    extra = next(p for p in got if p not in want)
    raise ValueError(f"{argument}{extra} is not in the {what}: {hint}")


def _with_path(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def per_device_zeros(tree, comm: Reduction, what: str = "residual") -> PerDevice:
    """Zeros shaped like `tree`'s leaves, with one leading row per device of
    `comm`, placed as :func:`per_device_copies` places them."""
    zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)), tree)
    return per_device_copies(zeros, comm, what, like=tree)


def placed_spec(x) -> tuple | None:
    """The PartitionSpec `x` is placed with, one entry per dimension, where it
    lies on a mesh (a ``NamedSharding``); else None."""
    if isinstance(x, jax.core.Tracer):  # inside a trace: shards, placed by the caller
        return None
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (len(jnp.shape(x)) - len(spec))


def place(x, spec: P):
    """`x` placed with `spec` on the mesh of ``jax.set_mesh``, where init
    runs under one; as it is inside a trace (its caller places it) or
    without a mesh."""
    if isinstance(x, jax.core.Tracer):
        return x
    mesh = jax.sharding.get_mesh()
    return x if mesh.empty else jax.device_put(x, NamedSharding(mesh, spec))


def _axes_entry(axes: tuple):
    return axes[0] if len(axes) == 1 else tuple(axes)


def per_device_copies(tree, comm: Reduction, what: str = "residual", like=None) -> PerDevice:
    """`tree`'s leaves repeated in one leading row per device of `comm`.

    Built under ``jax.set_mesh`` (outside shard_map), each leaf is placed
    with its rows split over `comm`'s axes and its other dimensions as the
    corresponding leaf of `like` (default `tree`) is placed: a residual of a
    parameter sharded over ``"fsdp"`` is sharded over ``"fsdp"`` too. That
    is what :func:`state_specs` reads, so the state enters ``shard_map`` as
    it is.
    """
    if not jax.tree.leaves(tree):
        return PerDevice(tree)
    rows, bound = devices_on(comm, what)
    row = _axes_entry(comm.axes)

    def copies(x, model):
        r = jnp.broadcast_to(jnp.asarray(x), (rows, *jnp.shape(x)))
        return r if bound else place(r, P(row, *(placed_spec(model) or ())))

    return PerDevice(jax.tree.map(copies, tree, tree if like is None else like))


def spec_axes(entry) -> tuple:
    """The mesh axes one entry of a PartitionSpec names: (), (a,) or the tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _typed_spec(x) -> tuple:
    """The spec in `x`'s type (its Explicit mesh axes under jit), or ()."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return tuple(spec) if spec is not None else ()


def in_shards(update, axes: tuple):
    """`update` (an optax update function reducing over `axes`), run on each
    device's shards where the gradients, state or params are split over
    other Explicit mesh axes in their types (jit with an Explicit "fsdp"
    axis, shard_map over the data axis only): a shard_map over those axes,
    which moves no data, so that the transform sees what it sees when the
    user's own shard_map is over both axes."""

    def wrapped(updates, state, params=None):
        tree = (updates, state, params)
        split = []
        for x in jax.tree.leaves(tree):
            for entry in _typed_spec(x):
                split += [a for a in spec_axes(entry) if a not in axes and a not in split]
        if not split:
            return update(updates, state, params)

        def specs(t):
            return jax.tree.map(lambda x: _only(P(*_typed_spec(x)), set(split)), t)

        run = jax.shard_map(
            lambda u, s, p: update(u, s, p),
            axis_names=set(split),
            in_specs=specs(tree),
            out_specs=(specs(updates), specs(state)),
        )
        return run(updates, state, params)

    return wrapped


def local(per_device: PerDevice):
    """This device's row of a PerDevice subtree (inside shard_map / pmap)."""
    return jax.tree.map(lambda x: x[0], per_device.value)


def as_row(tree) -> PerDevice:
    return PerDevice(jax.tree.map(lambda x: x[None], tree))


def state_specs(opt_state, axis_name, *, axis_names=None):
    """PartitionSpecs for carrying ``opt_state`` through ``jax.shard_map``.

    Shared leaves get ``P()``; leaves inside :class:`PerDevice` get
    ``P(axis_name)`` (their leading axis has one row per device). Takes an
    optax state, a Flax ``TrainState`` or NNX state (``nnx.state(optimizer)``,
    ``nnx.split((model, optimizer))[1]``, ``optimizer.opt_state``), and
    returns specs of the same structure.

    Given an NNX object itself (an ``nnx.Optimizer``), it returns the
    ``nnx.StateSharding`` that ``nnx.shard_map``'s ``in_specs`` take for it.

    A leaf placed on a mesh keeps the axes it is placed over: the state of a
    model sharded over another axis (``"fsdp"``, a tensor-parallel axis) is
    sharded like the model (:func:`per_device_copies`), and its specs say so.
    A ``shard_map`` manual over some axes only (``axis_names={"data"}``, XLA
    sharding the rest under ``jit``) takes specs that name only those: pass
    the same ``axis_names`` here (docs/sharded.md).

    ``optax.MultiSteps`` around a jaxcomm transform accumulates each device's
    local gradient, so its ``acc_grads`` get ``P(axis_name)`` too; built
    without a device axis (``tx.init`` outside ``shard_map``) it is refused,
    naming :func:`jaxcomm.accumulate`, which also sends once per k steps.
    ``optax.apply_if_finite`` around a jaxcomm transform is refused (it goes
    after it: docs/compose.md).

    Examples:
      >>> import jax, optax, jaxcomm
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = jaxcomm.allreduce_gradients("data", wire_dtype="float16", error_feedback=True)
      >>> with jax.set_mesh(mesh):
      ...     state = tx.init({"w": jax.numpy.zeros(3)})
      >>> specs = jaxcomm.state_specs(state, "data")
      >>> specs.residual.value["w"], specs.buffer
      (P('data',), ())
    """
    if _is_nnx_object(opt_state):
        from flax import nnx

        return nnx.StateSharding(
            state_specs(nnx.state(opt_state), axis_name, axis_names=axis_names)
        )
    _check_wrappers(opt_state, axis_name)
    if axis_names is not None:
        specs = state_specs(opt_state, axis_name)
        return jax.tree.map(
            lambda s: _only(s, set(axis_names)), specs, is_leaf=lambda s: isinstance(s, P)
        )
    spec = P(tuple(axis_name)) if isinstance(axis_name, (tuple, list)) else P(axis_name)

    def per_device(x):
        # Rows over the reduction's axes, the rest as the leaf is placed.
        placed = placed_spec(x)
        return _trimmed(*spec, *placed[1:]) if placed else spec

    def shared(x):
        return _trimmed(*(placed_spec(x) or ()))

    # Flax NNX state keeps the field names but not the PerDevice type.
    rows = [
        (*p, field, "value")
        for p in _jaxcomm_prefixes(opt_state) + _registered_prefixes(opt_state)
        for field in _per_device_fields_at(opt_state, p)
    ]

    def one(path, node):
        if isinstance(node, PerDevice):
            return PerDevice(jax.tree.map(per_device, node.value))
        if isinstance(node, optax.MultiStepsState):
            inner = state_specs(node.inner_opt_state, axis_name)
            local = _holds_jaxcomm_state(node.inner_opt_state)
            return optax.MultiStepsState(
                mini_step=P(),
                gradient_step=P(),
                inner_opt_state=inner,
                acc_grads=jax.tree.map(lambda _: spec if local else P(), node.acc_grads),
                skip_state=jax.tree.map(lambda _: P(), node.skip_state),
            )
        names = _names(path)
        if any(names[: len(r)] == r for r in rows):
            return per_device(node)
        return shared(node)

    return jax.tree_util.tree_map_with_path(
        one, opt_state, is_leaf=lambda x: isinstance(x, (PerDevice, optax.MultiStepsState))
    )


def _is_nnx_object(x) -> bool:
    try:
        from flax import nnx
    except ImportError:
        return False
    return nnx.graph.is_graph_node(x)


def _check_wrappers(opt_state, axis_name) -> None:
    """Refuses the optax wrappers that break a jaxcomm transform inside them,
    naming the fix: a conditional on each device's local gradient, and
    MultiSteps' accumulator built without a device axis."""
    paths = [_names(path) for path, _ in _with_path(opt_state)]
    for prefix in _jaxcomm_prefixes(opt_state):
        for i, name in enumerate(prefix):
            if name == "inner_state" and (*prefix[:i], "notfinite_count") in paths:
                raise ValueError(
                    f"optax.apply_if_finite wraps a jaxcomm transform (opt_state at "
                    f"{'/'.join(map(str, prefix[:i])) or 'the top'}): it would test each device's "
                    "local gradient, so devices could disagree on running the collective "
                    "and wait on each other for good. Put it after jaxcomm, which sends a "
                    "non-finite value to every device: optax.chain(jaxcomm.allreduce_gradients"
                    "(...), optax.apply_if_finite(optimizer, max_consecutive_errors))"
                )
    axis = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    for path, node in jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState)
    )[0]:
        if not isinstance(node, optax.MultiStepsState):
            continue
        if not _holds_jaxcomm_state(node.inner_opt_state):
            continue
        for leaf in jax.tree.leaves(node.acc_grads):
            placed = placed_spec(leaf) if isinstance(leaf, jax.Array) else None
            if placed is not None and not (placed and set(spec_axes(placed[0])) == set(axis)):
                raise ValueError(
                    f"optax.MultiSteps around a jaxcomm transform (opt_state"
                    f"{jax.tree_util.keystr(path)}): its accumulator holds each device's own "
                    "gradient but was built with no device axis (tx.init outside shard_map), "
                    "and MultiSteps runs the jaxcomm collective on every micro-step anyway. "
                    f"Use jaxcomm.accumulate(chain, {axis_name!r}, every_k=k) in its place: "
                    "it sends once per k micro-steps and builds its state like any jaxcomm "
                    "transform"
                )


def _trimmed(*entries) -> P:
    """P(*entries) without trailing Nones, as specs are written."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _only(spec: P, axes: set) -> P:
    """`spec` naming only `axes` (the others left to XLA)."""
    kept = [tuple(a for a in spec_axes(e) if a in axes) for e in spec]
    return _trimmed(*[(k[0] if len(k) == 1 else k) if k else None for k in kept])


def _per_device_fields_at(tree, prefix: tuple) -> set:
    """The PerDevice fields of the jaxcomm state at `prefix` of a container
    that dropped its type: those of every registered state whose fields
    include all the names found there (fields without leaves leave no name)."""
    here = {
        names[len(prefix)]
        for names in (_names(path) for path, _ in _with_path(tree))
        if len(names) > len(prefix) and names[: len(prefix)] == prefix
    }
    return {
        field
        for fields, per_device in _PER_DEVICE_FIELDS.items()
        if here <= fields
        for field in per_device
    }


def _holds_jaxcomm_state(tree) -> bool:
    stats = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, CommStats))
    return any(isinstance(s, CommStats) for s in stats) or bool(_jaxcomm_prefixes(tree))
