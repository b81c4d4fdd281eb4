"""Layers stacked in one leaf: a ``(layers, ...)`` leaf seen as ``layers`` leaves.

``nnx.vmap`` / ``nnx.scan`` over a block constructor and Linen's ``nn.scan``
keep each weight of a stack of layers as one leaf with a leading layer axis.
A transform that treats a leaf as one matrix (PowerSGD) must see each layer's
matrix instead: ``(4, 64, 64)`` is four 64 x 64 matrices, not one 4 x 4096.
Which leaves are stacked is read from the Flax metadata init sees (the layer
axis's partition name, ``"layers"`` as Flax's guides and MaxText name it) or
told by the user; the decision is made once, at init.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import jax

# The partition names of a stacking axis, as nnx.vmap's / nn.scan's
# transform_metadata={PARTITION_NAME: ...} writes them in the guides.
LAYER_NAMES = ("layers",)


class Stacks(NamedTuple):
    """How many layers each leaf stacks (0: not stacked), in leaf order."""

    counts: tuple

    def expand(self, leaves) -> list:
        """`leaves` with each stacked leaf replaced by its layers."""
        out = []
        for x, n in zip(leaves, self._counts(leaves), strict=True):
            out += [x[i] for i in range(n)] if n else [x]
        return out

    def collapse(self, leaves) -> list:
        """Inverse of :meth:`expand`: each stacked leaf's layers stacked again."""
        out, it = [], iter(leaves)
        for n in self.counts:
            out.append(jax.numpy.stack([next(it) for _ in range(n)]) if n else next(it))
        return out

    def repeat(self, per_leaf) -> list:
        """One entry per leaf -> one per expanded leaf (a stack's repeated)."""
        out = []
        for item, n in zip(per_leaf, self._counts(per_leaf), strict=True):
            out += [item] * (n or 1)
        return out

    def _counts(self, leaves):
        return self.counts if self.counts else (0,) * len(leaves)


def find(params, stacked, specs) -> Stacks:
    """Which leaves of `params` stack layers, per `stacked`: ``"auto"`` (Flax
    metadata naming the first axis one of :data:`LAYER_NAMES`), ``None``
    (none), a pytree prefix of bools, or a callable on the params giving one.
    A leaf split over the mesh along its layer axis is not taken as a stack
    (each shard would hold other layers). `specs`: per leaf, as placed."""
    leaves = jax.tree.leaves(params)
    if stacked is None:
        flags = [False] * len(leaves)
    elif isinstance(stacked, str):
        flags = [name in LAYER_NAMES for name in _first_names(params)]
    else:
        given = stacked(params) if callable(stacked) else stacked
        flags = jax.tree.leaves(
            jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub), given, params)
        )
    counts = [
        int(jax.numpy.shape(x)[0]) if flag and jax.numpy.ndim(x) >= 3 and not _split(spec) else 0
        for x, flag, spec in zip(leaves, flags, specs, strict=True)
    ]
    return Stacks(tuple(counts))


def _split(spec) -> bool:
    return bool(spec) and spec[0] is not None


def _first_names(params) -> list:
    """Per leaf, the partition name its Flax metadata gives its first axis, or None."""
    if "flax" not in sys.modules:
        return [None] * len(jax.tree.leaves(params))
    from flax import nnx
    from flax.core import meta

    boxes = (nnx.Variable, meta.AxisMetadata)
    out = []
    for node in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, boxes)):
        names = None
        if isinstance(node, nnx.Variable):
            names = node.get_metadata().get("out_sharding")
        elif isinstance(node, meta.Partitioned):
            names = node.names
        inner = jax.tree.leaves(node) if isinstance(node, boxes) else [node]
        out += [names[0] if names else None] * len(inner)
    return out
