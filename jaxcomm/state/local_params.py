"""local_params: the params at which a device takes its gradient.

The whole-optimizer transforms (:func:`jaxcomm.diloco`,
:func:`jaxcomm.double_buffered`) keep, per device, the params its next
gradient must be taken at; this reads them out of any optimizer state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm.state.per_device import LocalParams, local


def _holds(x) -> bool:
    """A NamedTuple state with a :class:`LocalParams` field: the mark is the
    field's type, so any state that declares one is found, with no table."""
    return (
        isinstance(x, tuple)
        and hasattr(x, "_fields")
        and any(isinstance(v, LocalParams) for v in x)
    )


def _transform(state_type) -> str:
    """The transform a state type belongs to: its module, one per transform."""
    return state_type.__module__.rsplit(".", 1)[-1]


def _holders(tree) -> list:
    """The states in `tree` with a LocalParams field."""
    return [s for s in jax.tree.leaves(tree, is_leaf=_holds) if _holds(s)]


def holds_local_params(tree) -> bool:
    """Whether `tree` (an optimizer state) holds a state with a LocalParams field."""
    return bool(_holders(tree))


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
    found = _holders(opt_state)
    if len(found) != 1:
        raise ValueError(
            "expected one diloco or double_buffered state (a state with a LocalParams "
            f"field) in the state, found {len(found)}"
        )
    held = next(v for v in found[0] if isinstance(v, LocalParams))
    rows = {jnp.shape(x)[0] for x in jax.tree.leaves(held.value)}
    if rows - {1}:
        raise ValueError(
            f"local_params reads this device's row, but the state holds {max(rows)} rows: "
            "call it inside jax.shard_map / jax.pmap, where each device sees its own"
        )
    params = local(held)
    if like is None:
        return params
    kind = _transform(type(found[0])) + " state"
    values, want = jax.tree.leaves(params), jax.tree.structure(like)
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
