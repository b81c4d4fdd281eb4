"""Per-device gradients of replicated params, for a jaxcomm transform to reduce.

Inside ``jax.shard_map``, params that enter replicated (``in_specs=P()``) are
typed as the same on every device, and ``jax.grad`` with respect to them
already sums the gradient over the devices. Reduced again by a jaxcomm
transform, that would be N times the mean, so the transforms refuse such a
gradient. ``local_grad`` differentiates at the same params typed as varying
(no data moves), which leaves the reduction to jaxcomm.
"""

from __future__ import annotations

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
        args = [to_varying(a, axis_name) if i in which else a for i, a in enumerate(args)]
        return differentiated(*args, **kwargs)

    return wrapped
