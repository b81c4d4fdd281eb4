"""Per-device state: the subtrees that differ device by device, and their placement.

Most of a transform's state is the same on every device (reduced gradients,
chunk masks, counters). Residuals are not: they hold what *this* device has
not sent yet. Such leaves are wrapped in :class:`PerDevice` and carry a
leading axis with one row per device, so that under ``shard_map`` they are
ordinary arrays sharded over the reduction axes (see
:func:`jaxcomm.state_specs`), and a checkpoint holds every device's residual.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives import Reduction


class PerDevice(NamedTuple):
    """A subtree whose leaves differ per device; each has a leading device axis.

    The mark is the field's own name, which shows in every key path: Flax NNX
    state (``nnx.state(optimizer)``) drops the NamedTuple types and keeps
    only names, and a name no user gives a param still says "per device"
    there, with no table of which fields of which state are per device.
    ``.value`` reads the subtree.
    """

    jaxcomm_per_device: Any

    @property
    def value(self) -> Any:
        return self.jaxcomm_per_device


class LocalParams(PerDevice):
    """The :class:`PerDevice` params a device takes its gradient at (diloco's
    and double_buffered's ``local``), which :func:`jaxcomm.local_params` reads."""

    __slots__ = ()


# The name that marks a per-device subtree in any key path, typed or not.
MARK = PerDevice._fields[0]


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
            "`with jax.set_mesh(mesh):` (build nnx.Optimizer or the TrainState there, "
            "with the mesh jaxcomm.data_parallel then runs the step on)"
        )
    return math.prod(sizes[a] for a in axes), False


def per_device_zeros(tree, comm: Reduction, what: str = "residual", specs=None) -> PerDevice:
    """Zeros shaped like `tree`'s leaves, with one leading row per device of
    `comm`, placed as :func:`per_device_copies` places them."""
    zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)), tree)
    return per_device_copies(zeros, comm, what, like=tree, specs=specs)


def per_device_copies(
    tree, comm: Reduction, what: str = "residual", like=None, specs=None
) -> PerDevice:
    """`tree`'s leaves repeated in one leading row per device of `comm`.

    Built under ``jax.set_mesh`` (outside shard_map), each leaf is placed
    with its rows split over `comm`'s axes and its other dimensions as the
    corresponding leaf of `like` (default `tree`) is placed: a residual of a
    parameter sharded over ``"fsdp"`` is sharded over ``"fsdp"`` too. That
    is what :func:`jaxcomm.state_specs` reads, so the state enters
    ``shard_map`` as it is. `specs` (per leaf, from :func:`declared_specs`)
    say it instead where the leaves were taken out of the params' tree
    (traced under ``jit``, only the tree's Flax metadata says).
    """
    if not jax.tree.leaves(tree):
        return PerDevice(tree)
    rows, bound = devices_on(comm, what)
    row = row_name(comm.axes)

    specs = iter(declared_specs(tree if like is None else like) if specs is None else specs)

    def copies(x):
        r = jnp.broadcast_to(jnp.asarray(x), (rows, *jnp.shape(x)))
        return r if bound else place(r, P(row, *(next(specs) or ())))

    copied = jax.tree.map(copies, tree)
    return PerDevice(_rows(copied, lambda x: x, lambda names: (row, *names)))


def row_name(axes: tuple):
    """The mesh axes the rows of a PerDevice leaf are split over, as one
    PartitionSpec entry."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def local(per_device: PerDevice):
    """This device's row of a PerDevice subtree (inside shard_map / pmap)."""
    return _rows(per_device.value, lambda x: x[0], lambda names: names[1:])


def as_row(tree, axes: tuple) -> PerDevice:
    """`tree` as this device's row of a PerDevice subtree split over `axes`."""
    row = row_name(axes)
    return PerDevice(_rows(tree, lambda x: x[None], lambda names: (row, *names)))


def _rows(tree, value, names):
    """`value` applied to each leaf of `tree`, and `names` to the
    partitioning names of the Flax metadata around it (an NNX Variable's
    ``out_sharding``, a Linen ``Partitioned`` box's names). Flax places
    state by that metadata (``nnx.Optimizer``, ``nn.get_partition_spec``):
    the rows of a param's state name the row axis first, and one row (what
    the param's own transforms see) names the param's axes only."""
    boxes = _flax_boxes()
    if not boxes:
        return jax.tree.map(value, tree)
    from flax import nnx
    from flax.core import meta

    def one(x):
        if isinstance(x, nnx.Variable):
            sharding = x.get_metadata().get("out_sharding")
            if not sharding:
                return x.replace(value=value(x.get_value()))
            return x.replace(value=value(x.get_value()), out_sharding=names(tuple(sharding)))
        if isinstance(x, meta.Partitioned):
            return x.replace(value=value(x.value), names=names(tuple(x.names)))
        return jax.tree.map(value, x)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, boxes))


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


_DECLARED: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_declared", default=None)


@contextlib.contextmanager
def declaring(params):
    """Inside the block, :func:`declared_specs` knows the params' leaves by
    identity even out of their tree (an init that splits the params into
    fragments, traced under ``jit``, where only the tree's metadata says
    how each leaf is split)."""
    leaves = jax.tree.leaves(params)
    table = {
        id(x): (x, spec) for x, spec in zip(leaves, declared_specs(params), strict=True) if spec
    }
    token = _DECLARED.set(table)
    try:
        yield
    finally:
        _DECLARED.reset(token)


def plain_structure(tree):
    """`tree`'s structure with Flax's metadata boxes taken as their values:
    the same for params as ``tx.init`` gets them (NNX Variables, Linen
    ``Partitioned`` boxes) and as ``tx.update`` gets the gradients (plain
    arrays from ``nnx.Optimizer``)."""
    boxes = _flax_boxes()
    if boxes:
        tree = jax.tree.map(
            lambda x: 0 if isinstance(x, boxes) else x, tree, is_leaf=lambda x: isinstance(x, boxes)
        )
    return jax.tree.structure(tree)


def shard_size(x, spec, skip: tuple = ()) -> int:
    """Elements of one device's shard of `x` placed with `spec` (None: whole),
    not counting splits over the axes `skip` (a reduction's, which hold
    copies)."""
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        sizes = dict(sharding.mesh.shape)
    n = int(math.prod(jnp.shape(x)))
    for a in {a for e in spec or () for a in spec_axes(e)} - set(skip):
        n //= sizes.get(a, 1)
    return n


def placed_like(tree, like: list, specs: list):
    """`tree` with each subtree that has `like`'s structure and shapes (an
    optax state's moments of a list of params) placed with `specs`, one per
    leaf (see :func:`place`)."""
    structure = jax.tree.structure(like)
    shapes = [jnp.shape(x) for x in like]

    def mirrors(node) -> bool:
        if jax.tree.structure(node) != structure:
            return False
        return [jnp.shape(x) for x in jax.tree.leaves(node)] == shapes

    def one(node):
        if not mirrors(node):
            return node
        leaves = [
            place(x, P(*spec)) if spec else x
            for x, spec in zip(jax.tree.leaves(node), specs, strict=True)
        ]
        return jax.tree.unflatten(structure, leaves)

    return jax.tree.map(one, tree, is_leaf=mirrors)


def declared_specs(tree) -> list:
    """Each leaf's placement (:func:`placed_spec`), in ``jax.tree.leaves``
    order, where the leaf is a placed array; inside a trace (``tx.init``
    under ``jit``, as a model sharded by ``out_shardings`` is built), the
    spec its Flax metadata declares: an NNX Variable's ``out_sharding``, a
    Linen ``Partitioned`` box's names, logical names through the active
    rules. None where neither says."""
    boxes = _flax_boxes()
    table = _DECLARED.get()
    out = []
    for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, boxes)):
        inner = jax.tree.leaves(node) if isinstance(node, boxes) else [node]
        for x in inner:
            spec = placed_spec(x)
            if spec is None and isinstance(node, boxes):
                spec = _box_spec(node, len(jnp.shape(x)))
            if spec is None and table and id(x) in table and table[id(x)][0] is x:
                spec = table[id(x)][1]
            out.append(_split_only(spec, x))
    return out


def _split_only(spec, x):
    """`spec` without the mesh axes of size 1, which split nothing (a
    model axis of 1: the model is whole on every device)."""
    if spec is None:
        return None
    sharding = getattr(x, "sharding", None)
    mesh = (
        sharding.mesh if isinstance(sharding, NamedSharding) else jax.sharding.get_abstract_mesh()
    )
    sizes = {} if mesh.empty else dict(mesh.shape)
    kept = [tuple(a for a in spec_axes(e) if sizes.get(a, 2) > 1) for e in spec]
    return tuple((k[0] if len(k) == 1 else k) if k else None for k in kept)


def _flax_boxes() -> tuple:
    """Flax's metadata types, where Flax is in use (else nothing to read)."""
    if "flax" not in sys.modules:
        return ()
    from flax import nnx
    from flax.core import meta

    return (nnx.Variable, meta.AxisMetadata)


def _box_spec(box, ndim: int) -> tuple | None:
    from flax import nnx
    from flax.core import meta

    if isinstance(box, nnx.Variable):
        if not box.get_metadata().get("out_sharding"):
            return None
        from flax.nnx import spmd

        spec = tuple(spmd.get_var_pspec(box))
    elif isinstance(box, meta.Partitioned):
        from flax.linen import spmd as linen_spmd

        logical = isinstance(box, linen_spmd.LogicallyPartitioned)
        names = linen_spmd.logical_to_mesh_axes(box.names, box.rules) if logical else box.names
        spec = tuple(names)
    else:
        return None
    return spec + (None,) * (ndim - len(spec))


def place(x, spec: P):
    """`x` placed with `spec` on the mesh of ``jax.set_mesh``, where init
    runs under one. Traced under ``jit`` on that mesh (a state built by a
    jitted init), `x` is constrained to `spec`, which is where the compiled
    init puts it unless its ``out_shardings`` say otherwise
    (:func:`jaxcomm.data_parallel` reads it there); inside ``shard_map`` or
    without a mesh, `x` is left as it is (its caller places it)."""
    named = {a for e in spec for a in spec_axes(e)}
    if isinstance(x, jax.core.Tracer):
        # Replicated (P()) too: left free, XLA would pick a placement of its own.
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.manual_axes or not named <= set(mesh.auto_axes):
            return x
        return jax.lax.with_sharding_constraint(x, spec)
    mesh = jax.sharding.get_mesh()
    return x if mesh.empty or not named else jax.device_put(x, NamedSharding(mesh, spec))


def spec_axes(entry) -> tuple:
    """The mesh axes one entry of a PartitionSpec names: (), (a,) or the tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def trimmed(*entries) -> P:
    """P(*entries) without trailing Nones, as specs are written."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def only(spec: P, axes: set) -> P:
    """`spec` naming only `axes` (the others left to XLA)."""
    kept = [tuple(a for a in spec_axes(e) if a in axes) for e in spec]
    return trimmed(*[(k[0] if len(k) == 1 else k) if k else None for k in kept])
