"""accumulate: gradient accumulation that communicates once per k micro-steps.

``optax.MultiSteps`` runs its inner chain (and so a jaxcomm collective) on
every micro-step and keeps the result on the k-th. Here each device sums its
own gradients for ``every_k`` micro-steps, and the inner chain, jaxcomm
transform first, runs inside a ``lax.cond`` on the k-th only: the compiled
step holds its collectives in that branch alone. The branch is chosen by a
counter that is the same on every device, so every device runs the
collective together (a predicate computed from local values could not
promise that).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import _validate
from jaxcomm.collectives import reduction, to_varying, varying_axes
from jaxcomm.state import per_device


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      mini_step: micro-steps since the last send, the same on every device.
      gradient_sum: ``PerDevice`` sum of this device's gradients since then.
      inner: the inner chain's state.
    """

    mini_step: jax.Array
    gradient_sum: Any
    inner: Any


def accumulate(
    inner: optax.GradientTransformation, axis_name, *, every_k: int
) -> optax.GradientTransformation:
    """Sums each device's gradients over ``every_k`` micro-steps, then runs ``inner`` once.

    Horovod's ``backward_passes_per_step`` and DDP's ``no_sync`` for jaxcomm:
    ``inner`` (a chain starting with a jaxcomm transform) sees the mean of the
    ``every_k`` local gradients on the k-th micro-step, and communicates then
    only; the other micro-steps return zero updates and leave its state as it
    is. Build the state as for any jaxcomm transform (``tx.init`` under
    ``jax.set_mesh``, :func:`jaxcomm.state_specs`).

    Args:
      inner: the chain to run every ``every_k`` micro-steps.
      axis_name: the axis ``inner`` reduces over (the sums are per device).
      every_k: micro-steps per update, at least 1.

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = jaxcomm.accumulate(
      ...     optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(1.0)), "data", every_k=2)
      >>> with jax.set_mesh(mesh):
      ...     state = tx.init(jnp.zeros(1))
      ...     specs = jaxcomm.state_specs(state, "data")
      ...     step = jax.jit(jax.shard_map(lambda g, s: tx.update(g[0], s), in_specs=(P("data"),
      ...                    specs), out_specs=(P(), specs)))
      ...     g = jax.device_put(jnp.ones((jax.device_count(), 1)), P("data"))
      ...     u1, state = step(g, state)  # first micro-step: nothing sent
      ...     u2, state = step(2 * g, state)  # second: the mean of 1 and 2, reduced
      >>> u1.tolist(), u2.tolist()
      ([0.0], [-1.5])
    """
    if not isinstance(every_k, int) or isinstance(every_k, bool) or every_k < 1:
        raise ValueError(f"every_k must be an int >= 1, got {every_k!r}")
    comm = reduction(axis_name)
    axes = comm.axes

    def init(params):
        return AccumulateState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_sum=per_device.per_device_zeros(params, comm, "gradient sum"),
            inner=inner.init(params),
        )

    def update(updates, state, params=None):
        _validate.check_same_tree(updates, per_device.local(state.gradient_sum), "gradient sum")
        total = jax.tree.map(jnp.add, per_device.local(state.gradient_sum), updates)
        send_now = state.mini_step == every_k - 1

        def send(total, inner_state, params):
            mean = jax.tree.map(lambda t, g: (t / every_k).astype(g.dtype), total, updates)
            return inner.update(mean, inner_state, params)

        def hold(total, inner_state, params):
            return jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), updates), inner_state

        operands = (total, state.inner, params)
        # Both branches must give each output the same type, including over
        # which axes it varies: the union of what each branch gives.
        sent = jax.make_jaxpr(send)(*operands).out_avals
        held = jax.make_jaxpr(hold)(*operands).out_avals
        vary = [
            tuple(sorted(set(varying_axes(a)) | set(varying_axes(b))))
            for a, b in zip(sent, held, strict=True)
        ]

        def typed(branch):
            def run(*args):
                out, tree = jax.tree.flatten(branch(*args))
                out = [to_varying(x, v) if v else x for x, v in zip(out, vary, strict=True)]
                return jax.tree.unflatten(tree, out)

            return run

        new_updates, new_inner = lax.cond(send_now, typed(send), typed(hold), *operands)
        kept = jax.tree.map(lambda t: jnp.where(send_now, jnp.zeros_like(t), t), total)
        new_sum = per_device.as_row(to_varying(kept, axes), axes)
        return new_updates, AccumulateState(
            mini_step=(state.mini_step + 1) % every_k, gradient_sum=new_sum, inner=new_inner
        )

    return optax.GradientTransformation(init, update)
