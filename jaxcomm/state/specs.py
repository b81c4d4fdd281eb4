"""state_specs: the PartitionSpecs a jaxcomm optimizer state enters shard_map
with, and the refusal of the optax wrappers that break a jaxcomm transform."""

from __future__ import annotations

import jax
import optax
from jax.sharding import PartitionSpec as P

from jaxcomm.state.comm_stats import holds_jaxcomm_state, jaxcomm_prefixes, names, with_path
from jaxcomm.state.per_device import MARK, PerDevice, only, placed_spec, spec_axes, trimmed


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
    sharded like the model, and its specs say so.
    A ``shard_map`` manual over some axes only (``axis_names={"data"}``, XLA
    sharding the rest under ``jit``) takes specs that name only those: pass
    the same ``axis_names`` here (docs/sharded.md).

    ``optax.MultiSteps`` around a jaxcomm transform accumulates each device's
    local gradient, so its ``acc_grads`` get ``P(axis_name)`` too; built
    without a row per device (``tx.init`` outside ``shard_map``) it is refused,
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
    if is_nnx_object(opt_state):
        from flax import nnx

        return nnx.StateSharding(
            state_specs(nnx.state(opt_state), axis_name, axis_names=axis_names)
        )
    _check_wrappers(opt_state, axis_name)
    if axis_names is not None:
        specs = state_specs(opt_state, axis_name)
        return jax.tree.map(
            lambda s: only(s, set(axis_names)), specs, is_leaf=lambda s: isinstance(s, P)
        )
    spec = P(tuple(axis_name)) if isinstance(axis_name, (tuple, list)) else P(axis_name)

    def per_device(x):
        # Rows over the reduction's axes, the rest as the leaf is placed.
        placed = placed_spec(x)
        return trimmed(*spec, *placed[1:]) if placed else spec

    def one(path, node):
        if isinstance(node, PerDevice):
            return type(node)(jax.tree.map(per_device, node.value))
        if isinstance(node, optax.MultiStepsState):
            inner = state_specs(node.inner_opt_state, axis_name)
            local = holds_jaxcomm_state(node.inner_opt_state)
            return optax.MultiStepsState(
                mini_step=P(),
                gradient_step=P(),
                inner_opt_state=inner,
                acc_grads=jax.tree.map(lambda _: spec if local else P(), node.acc_grads),
                skip_state=jax.tree.map(lambda _: P(), node.skip_state),
            )
        # Flax NNX state drops the PerDevice type but keeps its field's name.
        if MARK in names(path):
            return per_device(node)
        return trimmed(*(placed_spec(node) or ()))

    return jax.tree_util.tree_map_with_path(
        one, opt_state, is_leaf=lambda x: isinstance(x, (PerDevice, optax.MultiStepsState))
    )


def is_nnx_object(x) -> bool:
    try:
        from flax import nnx
    except ImportError:
        return False
    return nnx.graph.is_graph_node(x)


def _check_wrappers(opt_state, axis_name) -> None:
    """Refuses the optax wrappers that break a jaxcomm transform inside them,
    naming the fix: a conditional on each device's local gradient, and
    MultiSteps' accumulator built without a device axis."""
    paths = [names(path) for path, _ in with_path(opt_state)]
    for prefix in jaxcomm_prefixes(opt_state):
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
        if not holds_jaxcomm_state(node.inner_opt_state):
            continue
        for leaf in jax.tree.leaves(node.acc_grads):
            placed = placed_spec(leaf) if isinstance(leaf, jax.Array) else None
            if placed is not None and not (placed and set(spec_axes(placed[0])) == set(axis)):
                raise ValueError(
                    f"optax.MultiSteps around a jaxcomm transform (opt_state"
                    f"{jax.tree_util.keystr(path)}): its accumulator holds each device's own "
                    "gradient but is shaped like the params, with no row per device, "
                    "and MultiSteps runs the jaxcomm collective on every micro-step anyway. "
                    f"Use jaxcomm.accumulate(chain, {axis_name!r}, every_k=k) in its place: "
                    "it sends once per k micro-steps and builds its state like any jaxcomm "
                    "transform"
                )
