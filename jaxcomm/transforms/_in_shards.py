"""in_shards: a transform's update run on each device's shards of a model
split over other mesh axes (Explicit ones, or Auto ones in a data-parallel step)."""

from __future__ import annotations

import warnings

import jax
from jax.sharding import PartitionSpec as P

from jaxcomm.state.per_device import only, spec_axes
from jaxcomm.step import current_axis, placement


def _spec(x) -> P:
    """How `x` is split over mesh axes its shard_map left to XLA: the spec
    in its type (Explicit axes, under jit), else its placement as an argument
    of a :func:`jaxcomm.data_parallel` step (Auto axes), else ()."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is not None and any(e is not None for e in spec):
        return P(*spec)
    placed = placement(x)
    return placed if placed is not None else P()


def _auto_axes(axes) -> list:
    """The Auto axes of the mesh the update is traced under, but `axes`.

    jaxcomm's exchange must not run where XLA partitions the values itself:
    a custom call or a narrowed collective there is run on every device of
    those axes with operands XLA picked, which can abort XLA or hang the
    transport. So the update runs manual over them too: on each device's
    shards where their placement is known (a :func:`jaxcomm.data_parallel`
    step), else on whole copies, which costs their size on the wire again.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return []
    auto = [a for a in mesh.auto_axes if a not in axes]
    if auto and current_axis() is None:
        warnings.warn(
            f"jaxcomm: the optimizer's update runs inside a shard_map over {tuple(axes)} "
            f"whose other mesh axes {tuple(auto)} are Auto: jaxcomm cannot see how XLA "
            "split the gradients over them, so each device exchanges whole copies. Use "
            "jaxcomm.data_parallel for the step, make the shard_map manual over every axis, "
            "or make those axes Explicit, to exchange each device's shards only",
            stacklevel=4,
        )
    return auto


def _is_p(s) -> bool:
    return isinstance(s, P)


def in_shards(update, axes: tuple):
    """`update` (an optax update function reducing over `axes`), run on each
    device's shards where the gradients, state or params are split over
    other mesh axes: Explicit ones in their types (jit with an Explicit
    "fsdp" axis, shard_map over the data axis only), or Auto ones that
    :func:`jaxcomm.data_parallel` saw them placed over (a model sharded by
    ``jit``'s propagation). A shard_map over those axes, which moves no data
    where the values are split as their params are, so that the transform
    sees what it sees when the user's own shard_map is over both axes. A
    gradient is taken to be split as its param is."""

    def wrapped(updates, state, params=None):
        tree = (updates, state, params)
        specs = jax.tree.map(_spec, tree)
        if params is not None and jax.tree.structure(updates) == jax.tree.structure(params):
            grads = jax.tree.map(lambda u, p: u if len(u) else p, *specs[::2], is_leaf=_is_p)
            specs = (grads, *specs[1:])
        split = _auto_axes(axes)
        for spec in jax.tree.leaves(specs, is_leaf=_is_p):
            for entry in spec:
                split += [a for a in spec_axes(entry) if a not in axes and a not in split]
        sizes = dict(jax.sharding.get_abstract_mesh().shape)
        split = [a for a in split if sizes.get(a, 2) > 1]  # an axis of 1 splits nothing
        if not split:
            return update(updates, state, params)
        kept = jax.tree.map(lambda s: only(s, set(split)), specs, is_leaf=_is_p)
        run = jax.shard_map(
            lambda u, s, p: update(u, s, p),
            axis_names=set(split),
            in_specs=kept,
            out_specs=(kept[0], kept[1]),
        )
        return run(updates, state, params)

    return wrapped
