"""local_params: the params at which a device takes its gradient.

The whole-optimizer transforms (:func:`jaxcomm.diloco`,
:func:`jaxcomm.double_buffered`) keep, per device, the params its next
gradient must be taken at; this reads them out of any optimizer state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm.transforms import _state

# The state types that keep a ``local`` PerDevice copy of the params, and
# the name of the transform each belongs to (for errors).
_HOLDERS: dict[type, str] = {}


def holds_local_params(state_type, transform: str) -> None:
    """Records that ``state_type`` (the NamedTuple state of ``transform``)
    keeps ``local``: PerDevice params."""
    _HOLDERS[state_type] = transform


def local_params(opt_state, like=None):
    """This device's params in the state of a :func:`jaxcomm.diloco` or
    :func:`jaxcomm.double_buffered` (inside ``shard_map``).

    Take the gradient at these: for diloco what this device's inner steps
    moved since the last sync, for double_buffered where this device predicts
    the params its gradient will be applied to. Works on the state of an
    ``optax.chain`` or any nesting of it, like :func:`jaxcomm.get_stats`, and
    on a Flax ``nnx.Optimizer``'s ``opt_state``. Outside ``shard_map``,
    ``state.local.value`` holds every device's params, one row per device.

    Args:
      opt_state: the optimizer state holding one such state.
      like: optional tree with the params' structure (for Flax NNX,
        ``nnx.state(model, nnx.Param)``); the values come back in it, so
        ``nnx.merge`` takes them as the model's params.
    """
    holders = tuple(_HOLDERS)
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, holders))
        if isinstance(s, holders)
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected one {' or '.join(_HOLDERS.values())} state in the state, found {len(found)}"
        )
    rows = {jnp.shape(x)[0] for x in jax.tree.leaves(found[0].local.value)}
    if rows - {1}:
        raise ValueError(
            f"local_params reads this device's row, but the state holds {max(rows)} rows: "
            "call it inside jax.shard_map / jax.pmap, where each device sees its own"
        )
    local = _state.local(found[0].local)
    if like is None:
        return local
    kind = _HOLDERS[type(found[0])] + " state"
    values, want = jax.tree.leaves(local), jax.tree.structure(like)
    if len(values) != want.num_leaves:
        raise ValueError(
            f"local_params: like has {want.num_leaves} leaves but the {kind} holds "
            f"{len(values)} params"
        )
    for (path, leaf), value in zip(jax.tree_util.tree_leaves_with_path(like), values, strict=True):
        if jnp.shape(leaf) != jnp.shape(value):
            raise ValueError(
                f"local_params: like{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)} "
                f"but the {kind}'s param there has {jnp.shape(value)}"
            )
    return jax.tree.unflatten(want, values)
