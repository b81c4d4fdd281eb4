"""A toy compression transform, written by following docs/contributing.md alone.

``scaled_sign`` sends, for each leaf, the sign of this device's gradient plus
its error-feedback residual, times the mean magnitude (one scale per leaf and
device: signSGD with error feedback, Karimireddy et al. 2019), and keeps what
that dropped as the next step's residual. The sum over devices is a plain
allreduce of the scaled signs; the wire is left to the user (``wire_dtype``).

It is in tests/ because it is a worked example of the contract, not a method
jaxcomm recommends: tests/catalog.py lists it, so every test that runs the
catalog (state types, Flax NNX and Linen, Orbax checkpoints, optax wrappers,
the refusal of already-reduced gradients) runs it too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _validate
from jaxcomm.collectives import reduction
from jaxcomm.state import CommStats, PerDevice
from jaxcomm.state.comm_stats import any_nonfinite, empty_stats
from jaxcomm.state.per_device import as_row, local, per_device_zeros
from jaxcomm.transforms._buckets import reduce_in_buckets
from jaxcomm.transforms._in_shards import in_shards


class ScaledSignState(NamedTuple):
    """State of :func:`scaled_sign`.

    Attributes:
      residual: what this device's scaled signs have not sent yet, one row per
        device (the ``PerDevice`` type is what marks it per device).
      stats: :class:`jaxcomm.CommStats` of the last step.
    """

    residual: PerDevice
    stats: CommStats


def scaled_sign(
    axis_name, *, wire_dtype=None, backend: str = "auto"
) -> optax.GradientTransformation:
    """The mean over ``axis_name`` of each device's scaled sign of its gradient.

    Args:
      axis_name: the mesh axis (or axes) to average over.
      wire_dtype: the dtype the signs travel in (None: the gradient's).
      backend: ``"auto"``, ``"xla"`` or ``"ffi"``, as in :func:`jaxcomm.allreduce`.
    """
    # Checked here, when the optimizer is built: a bad option fails before any step.
    comm = reduction(axis_name, op="mean", wire_dtype=wire_dtype, backend=backend)

    def init(params):
        return ScaledSignState(residual=per_device_zeros(params, comm), stats=empty_stats())

    def update(updates, state, params=None):
        del params
        comm.check_dtypes(updates)
        _validate.check_same_tree(updates, local(state.residual), "error-feedback residual")
        bound = comm.bind()
        bound.check_local(updates)  # refuses a gradient jax.grad already summed
        corrected = jax.tree.map(jnp.add, updates, local(state.residual))
        sent = jax.tree.map(lambda c: jnp.sign(c) * jnp.mean(jnp.abs(c)), corrected)
        leaves, treedef = jax.tree.flatten(sent)
        reduced, payload, count = reduce_in_buckets(leaves, bound, bound.default_bucket_bytes)
        reduced = jax.tree.unflatten(treedef, reduced)
        nonfinite = any_nonfinite(reduced)
        # A non-finite step must not poison the residual for good.
        residual = jax.tree.map(
            lambda c, s, old: jnp.where(nonfinite, old, c - s),
            corrected,
            sent,
            local(state.residual),
        )
        stats = CommStats(
            payload_bytes=jnp.float32(payload),
            bytes_sent=bound.bytes_sent(payload),
            collectives=jnp.int32(count),
            density=jnp.float32(1),
            nonfinite=nonfinite,
        )
        return reduced, ScaledSignState(as_row(residual, comm.axes), stats)

    # in_shards: the same update on each device's shards of a sharded model.
    return optax.GradientTransformation(init, in_shards(update, comm.axes))
