"""double_buffered: double buffering whose gradient is taken where it lands.

Plain double buffering (``allreduce_gradients(double_buffering=True)``)
applies at step t the mean gradient of step t-1, taken at the params of step
t-1: one step stale, which AdamW pays for dearly (docs/double_buffering.md).
Here the optimizer's state and the params the caller holds follow the
synchronous trajectory, one step behind; each device takes its gradient at
its own prediction of the next params, the synced ones advanced by the
inner optimizer's step on its own latest gradient. The mean of the devices'
predictions is the synchronous step, so the gradient the mean applies is
fresh up to a zero-mean perturbation of each device's point. With plain SGD
this is delayed gradient averaging (Zhu et al. 2021) with a delay of one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate
from jaxcomm.collectives import reduction
from jaxcomm.state import per_device
from jaxcomm.transforms import _in_shards
from jaxcomm.transforms.allreduce_gradients import allreduce_gradients


class DoubleBufferedState(NamedTuple):
    """State of :func:`double_buffered`.

    Attributes:
      local: ``LocalParams`` (a ``PerDevice``) params at which each device takes its next
        gradient (:func:`jaxcomm.local_params`).
      inner: the inner optimizer's state, the same on every device (it has
        seen the mean gradients up to the previous step).
      reduce: the :class:`jaxcomm.AllReduceGradientsState` of the exchange
        (its double buffer, residual and stats).
      count: int32, steps taken.
    """

    local: per_device.LocalParams
    inner: Any
    reduce: Any
    count: jax.Array


def double_buffered(
    inner: optax.GradientTransformation,
    axis_name,
    *,
    wire_dtype=None,
    error_feedback: bool = False,
    bucket_bytes: float | None = None,
    algorithm: str = "auto",
    backend: str = "auto",
) -> optax.GradientTransformation:
    """Double buffering around ``inner``, with each gradient taken where it lands.

    A whole optimizer (put nothing after it in a chain), used inside
    ``jax.shard_map`` or ``jax.pmap``; take the gradient at this device's
    :func:`jaxcomm.local_params` ``(state)``. ``params`` are the synced ones,
    the same on every device. With ``g_i`` device i's gradient of this step,
    ``b_i`` its gradient of the previous step and ``mean`` over the devices::

      u, s <- inner.update(mean(b_i), s, params)   (zeros, s unchanged at step 0)
      local_i <- (params + u) + inner.update(g_i, s, params + u)[0]

    and returns ``u``. The collective reads only ``b_i``, so it runs under the
    step's forward and backward passes as in
    ``allreduce_gradients(double_buffering=True)``; the gradient it delivers
    was taken at ``local_i``, whose mean over the devices is the synchronous
    step's params. Its quality against plain double buffering: docs/double_buffering.md.

    Args:
      inner: the optimizer, its state the same on every device; it runs twice a
        step (the second on this device's gradient, that state discarded).
      axis_name: mesh or pmap axis name(s), as in :func:`jaxcomm.allreduce`.
      wire_dtype, error_feedback, bucket_bytes: as in :func:`jaxcomm.allreduce_gradients`.
      algorithm, backend: as in :func:`jaxcomm.allreduce`.

    Returns:
      An ``optax.GradientTransformation`` with :class:`DoubleBufferedState`,
      whose ``PerDevice`` parts :func:`jaxcomm.state_specs` places; init needs
      the axis size (inside ``shard_map`` or under ``jax.set_mesh``).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = jaxcomm.double_buffered(optax.sgd(0.1), "data")
      >>> params = {"w": jnp.zeros(3)}
      >>> with jax.set_mesh(mesh):
      ...     state = tx.init(params)
      >>> specs = jaxcomm.state_specs(state, "data")
      >>> def loss(p, x):
      ...     return jnp.sum((p["w"] - x) ** 2)
      >>> def step(params, state, x):
      ...     grads = jax.grad(loss)(jaxcomm.local_params(state), x[0])
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
      ...                             out_specs=(P(), specs)))
      >>> state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
      >>> x = jnp.arange(3.0 * jax.device_count()).reshape(-1, 3)  # one row per device
      >>> x = jax.device_put(x, NamedSharding(mesh, P("data")))
      >>> for _ in range(2):  # one step in flight at a time
      ...     params, state = jax.block_until_ready(run(params, state, x))
      >>> # step 0 applied nothing; step 1 the mean gradient of step 0, -2 mean(x)
      >>> bool(jnp.allclose(params["w"], 0.2 * x.mean(0)))
      True

    References:
      Zhu et al., `Delayed Gradient Averaging: Tolerate the Communication Latency
      for Federated Learning <https://proceedings.neurips.cc/paper/2021/hash/fc03d48253286a798f5116ec00e99b2b-Abstract.html>`_,
      NeurIPS 2021
    """
    _validate.check_optimizer("inner", inner)
    exchange = allreduce_gradients(
        axis_name,
        wire_dtype=wire_dtype,
        error_feedback=error_feedback,
        bucket_bytes=bucket_bytes,
        algorithm=algorithm,
        backend=backend,
        double_buffering=True,
    )
    comm = reduction(axis_name, op="mean", algorithm=algorithm, backend=backend)

    def init(params):
        return DoubleBufferedState(
            local=per_device.LocalParams(
                per_device.per_device_copies(params, comm, "local params").value
            ),
            inner=inner.init(params),
            reduce=exchange.init(params),
            count=jnp.int32(0),
        )

    def update(grads, state, params=None):
        if params is None:
            raise ValueError(
                "double_buffered's update needs params: the synced params, "
                "tx.update(grads, state, params)"
            )
        mean, reduce_state = exchange.update(grads, state.reduce, params)
        # Step 0 has no previous gradient: the buffer is zeros, and an AdamW
        # step on zeros would still advance its bias correction. Selects, not
        # a lax.cond: XLA fuses them into the optimizer's elementwise passes,
        # where a cond made it write the step's update and state out first.
        first = state.count == 0
        u, inner_state = inner.update(mean, state.inner, params)
        u = jax.tree.map(lambda x: jnp.where(first, jnp.zeros_like(x), x), u)
        inner_state = jax.tree.map(lambda a, b: jnp.where(first, a, b), state.inner, inner_state)
        synced = optax.apply_updates(params, u)
        ahead, _ = inner.update(grads, inner_state, synced)
        local = optax.apply_updates(synced, ahead)
        new = DoubleBufferedState(
            local=per_device.LocalParams(per_device.as_row(local, comm.axes).value),
            inner=inner_state,
            reduce=reduce_state,
            count=state.count + 1,
        )
        return u, new

    return optax.GradientTransformation(init, _in_shards.in_shards(update, comm.axes))
