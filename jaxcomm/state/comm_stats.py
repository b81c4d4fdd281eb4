"""CommStats: what a step communicated, and finding it in any optimizer state.

The stats of a sharded model's shards are agreed over the shards
(:func:`agreed_mean`, :func:`agreed_any`) so that every device reports, and
skips, the same.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm.collectives import over_shards, varying_axes


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


def agreed_mean(x, over: tuple) -> jax.Array:
    """`x` (a float scalar) averaged over the axes of `over` it is typed as
    varying over (inside shard_map): the shards of a sharded model (`over`,
    "fsdp"), whose stats differ shard by shard, report one value."""
    return over_shards.pmean(x, tuple(a for a in varying_axes(x) if a in over))


def agreed_any(flag) -> jax.Array:
    """`flag` (a bool scalar), true on every device where it is true on one
    of the devices it is typed as varying over (inside shard_map)."""
    return over_shards.any_true(flag, varying_axes(flag))


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


def names(path) -> tuple:
    """A key path as plain names: nnx.State turns a NamedTuple's fields
    (GetAttrKey) into dict keys (DictKey), so only the names compare."""
    return tuple(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))) for k in path)


def with_path(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def jaxcomm_prefixes(tree) -> list[tuple]:
    """Where a jaxcomm state sits in a container that dropped its types
    (nnx.state(optimizer) holds nested dicts): every path with a ``stats``
    entry holding exactly the fields of CommStats."""
    fields: dict[tuple, set] = {}
    for path, _ in with_path(tree):
        keys = names(path)
        for i, name in enumerate(keys[:-1]):
            if name == "stats" and keys[i + 1] in CommStats._fields:
                fields.setdefault(keys[:i], set()).add(keys[i + 1])
    return [p for p, f in fields.items() if f == set(CommStats._fields)]


def _stats_by_name(tree) -> list[CommStats]:
    found = []
    for prefix in jaxcomm_prefixes(tree):
        leaves = {}
        for path, x in with_path(tree):
            keys = names(path)
            if keys[: len(prefix) + 1] == (*prefix, "stats"):
                leaves[keys[len(prefix) + 1]] = x
        found.append(CommStats(**leaves))
    return found


def holds_jaxcomm_state(tree) -> bool:
    """Whether `tree` holds a jaxcomm transform's state, typed or not."""
    stats = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, CommStats))
    return any(isinstance(s, CommStats) for s in stats) or bool(jaxcomm_prefixes(tree))
