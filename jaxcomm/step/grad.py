"""``value_and_grad`` and ``grad`` for jaxcomm steps, Flax NNX modules included.

A jaxcomm transform wants each device's own gradient (see
:mod:`jaxcomm.step.local_grad`). For plain functions of arrays these are
:func:`jaxcomm.local_value_and_grad` and :func:`jaxcomm.local_grad`. A Flax
NNX module is differentiated with ``nnx.value_and_grad``, which also carries
the module's other state out of the trace (BatchNorm statistics, RNG
counts); here its ``nnx.Param`` values are typed as varying for the
duration of the call, and put back afterwards, so that the gradient is
local and everything else behaves as under ``nnx.value_and_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from jaxcomm.collectives import to_varying
from jaxcomm.state import local_params
from jaxcomm.step.context import current_axis, local_params_states
from jaxcomm.step.local_grad import local_grad, local_value_and_grad


def value_and_grad(
    fun: Callable,
    axis_name=None,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable:
    """Like ``nnx.value_and_grad`` / ``jax.value_and_grad``, with each device's own gradient.

    Args:
      fun: the loss, of an NNX module or of arrays (as for ``nnx.value_and_grad``).
      axis_name: the axis the transform reduces over; inside
        :func:`jaxcomm.data_parallel` it defaults to that step's axis.
      argnums: which positional arguments to differentiate.
      has_aux: as for ``jax.value_and_grad``.

    Returns:
      A function with ``fun``'s arguments returning ``(value, grads)`` (value
      ``(loss, aux)`` with ``has_aux``), the value and gradient of this
      device's data only. Module state other than ``nnx.Param`` (BatchNorm
      statistics, RNG counts) is updated as ``nnx.value_and_grad`` does.
      Inside a :func:`jaxcomm.data_parallel` step whose optimizer keeps each
      device's params (``diloco``, ``double_buffered``), a module's gradient
      is taken at those (:func:`jaxcomm.local_params`), as they require.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> opt = nnx.Optimizer(model, optax.chain(jaxcomm.allreduce_gradients("data"),
      ...                                        optax.sgd(0.1)), wrt=nnx.Param)
      >>> @jaxcomm.data_parallel
      ... def step(model, opt, x):
      ...     loss, grads = jaxcomm.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
      ...     opt.update(model, grads)
      ...     return loss
      >>> loss = step(model, opt, jnp.ones((jax.device_count(), 2)))
      >>> loss.shape
      ()
    """
    return _differentiate(True, fun, axis_name, argnums, has_aux)


def grad(
    fun: Callable,
    axis_name=None,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable:
    """Like :func:`value_and_grad`, returning the gradient only (and aux with ``has_aux``)."""
    return _differentiate(False, fun, axis_name, argnums, has_aux)


def _differentiate(with_value, fun, axis_name, argnums, has_aux):
    which = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def wrapped(*args, **kwargs):
        axes = _axis(axis_name)
        if not any(_holds_module(args[i]) for i in which if i < len(args)):
            plain = local_value_and_grad if with_value else local_grad
            return plain(fun, axes, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
        from flax import nnx

        transform = nnx.value_and_grad if with_value else nnx.grad
        modules = [args[i] for i in which if _holds_module(args[i])]
        arrays = {i: to_varying(args[i], axes) for i in which if not _holds_module(args[i])}
        args = [arrays.get(i, a) for i, a in enumerate(args)]
        # nnx.state holds the modules' own Variables: tree.map copies the values.
        params = nnx.state(modules, nnx.Param)
        saved = jax.tree.map(lambda x: x, params)
        nnx.update(modules, jax.tree.map(lambda x: to_varying(x, axes), _at(params)))
        try:
            return transform(fun, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
        finally:
            nnx.update(modules, saved)  # the optimizer updates the params as they were

    return wrapped


def _at(params):
    """Where to take the gradient: inside a data_parallel step whose optimizer
    keeps each device's params (diloco, double_buffered), at those; else at
    the params."""
    held = local_params_states()
    if len(held) > 1:
        raise ValueError(
            "jaxcomm.value_and_grad: the step has several optimizers that keep each "
            "device's params (diloco, double_buffered); it cannot tell which one the model "
            "belongs to: take the gradient at jaxcomm.local_params(optimizer.opt_state, "
            "like=nnx.state(model, nnx.Param)) yourself"
        )
    return local_params(held[0], like=params) if held else params


def _axis(axis_name):
    axes = current_axis() if axis_name is None else axis_name
    if axes is None:
        raise ValueError(
            "axis_name is required outside jaxcomm.data_parallel: pass the axis the "
            "gradient will be reduced over, e.g. jaxcomm.value_and_grad(loss_fn, 'data')"
        )
    return axes


def _holds_module(tree) -> bool:
    """Whether `tree` is or contains a Flax NNX graph node (a Module, an Optimizer)."""
    try:
        from flax import nnx
    except ImportError:
        return False
    nodes = jax.tree.leaves(tree, is_leaf=nnx.graph.is_graph_node)
    return any(nnx.graph.is_graph_node(x) for x in nodes)
