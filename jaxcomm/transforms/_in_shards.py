"""in_shards: a transform's update run on each device's shards of a model
split over other Explicit mesh axes."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxcomm.state.per_device import only, spec_axes


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
            return jax.tree.map(lambda x: only(P(*_typed_spec(x)), set(split)), t)

        run = jax.shard_map(
            lambda u, s, p: update(u, s, p),
            axis_names=set(split),
            in_specs=specs(tree),
            out_specs=(specs(updates), specs(state)),
        )
        return run(updates, state, params)

    return wrapped
