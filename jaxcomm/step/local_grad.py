"""Per-device gradients of replicated params, for a jaxcomm transform to reduce.

Inside ``jax.shard_map``, params that enter replicated (``in_specs=P()``) are
typed as the same on every device, and ``jax.grad`` with respect to them
already sums the gradient over the devices. Reduced again by a jaxcomm
transform, that would be N times the mean, so the transforms refuse such a
gradient. ``local_grad`` differentiates at the same params typed as varying
(no data moves), which leaves the reduction to jaxcomm.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import jax

from jaxcomm.collectives import to_varying


def local_grad(
    fun: Callable, axis_name, *, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """Like ``jax.grad(fun)``, but each device gets the gradient of its own data only.

    Args:
      fun: the loss, as for ``jax.grad``.
      axis_name: the mesh axis (or tuple of axes) the gradient will be reduced
        over: the transform's ``axis_name``.
      argnums: which positional arguments to differentiate, as for ``jax.grad``.
      has_aux: as for ``jax.grad``.

    Returns:
      A function with ``fun``'s arguments returning the local gradient (and
      the aux value with ``has_aux``), ready for ``tx.update``.

    Raises:
      ValueError: a differentiated argument holds a Flax NNX Module (or another
        nnx object): ``jax.grad`` would drop its state updates. Use
        ``jaxcomm.value_and_grad`` / ``jaxcomm.grad``, or differentiate the
        ``nnx.Param`` state from ``nnx.split``.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> loss = lambda w, x: jnp.sum(w * x)
      >>> def grads(w, x):
      ...     return jaxcomm.local_grad(loss, "data")(w, x[0])[None]
      >>> x = jnp.arange(jax.device_count(), dtype=jnp.float32)[:, None]
      >>> x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
      >>> g = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")),
      ...                           out_specs=P("data")))(jnp.ones(1), x)
      >>> g[:, 0].tolist() == x[:, 0].tolist()  # each device's own x, not their sum
      True
    """
    return _local(jax.grad, fun, axis_name, argnums, has_aux)


def local_value_and_grad(
    fun: Callable, axis_name, *, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """Like ``jax.value_and_grad(fun)``, with :func:`local_grad`'s local gradient.

    The value is this device's loss.
    """
    return _local(jax.value_and_grad, fun, axis_name, argnums, has_aux)


def _local(transform, fun, axis_name, argnums, has_aux):
    which = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    differentiated = transform(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args, **kwargs):
        for i in which:
            if i < len(args):
                _refuse_nnx_objects(transform, i, args[i])
        args = [to_varying(a, axis_name) if i in which else a for i, a in enumerate(args)]
        return differentiated(*args, **kwargs)

    return wrapped


def _refuse_nnx_objects(transform, index: int, arg) -> None:
    """Raises ValueError where `arg` holds an NNX Module, Rngs or other
    ``nnx.Object``: ``jax.grad`` of one mutates it inside the trace and loses
    what changed (BatchNorm's running statistics; Dropout's RNG count fails
    with a TraceContextError). Variables alone, as in the ``nnx.State`` that
    ``nnx.split`` gives, are plain pytrees here and pass."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:  # no NNX object exists before flax.nnx is imported
        return

    def is_object(x) -> bool:
        return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)

    found = jax.tree_util.tree_flatten_with_path(arg, is_leaf=is_object)[0]
    for path, leaf in found:
        if is_object(leaf):
            where = f"argument {index}{jax.tree_util.keystr(path)}"
            name = "local_grad" if transform is jax.grad else "local_value_and_grad"
            raise ValueError(
                f"{name}: {where} (argnums) is a Flax NNX {type(leaf).__name__}; jax.grad of "
                "an NNX object loses its state updates (BatchNorm's running statistics, "
                "Dropout's RNG state). Use jaxcomm.value_and_grad(loss_fn, axis_name)(model, "
                "...) or jaxcomm.grad, which take NNX modules, or split the module with "
                "graphdef, params, rest = nnx.split(model, nnx.Param, ...) and differentiate "
                "params (nnx.merge(graphdef, params, rest) inside the loss)"
            )
