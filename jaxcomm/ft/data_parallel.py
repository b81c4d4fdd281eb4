"""Per-step data parallelism across replica groups that come and go.

Every step is a round: each group sends its gradient, the mean over the
quorum's groups goes through the optax chain, and the step commits on every
group or on none. An aborted step is lost (the groups keep their committed
params and optimizer state); nothing before it is.
"""

from __future__ import annotations

import jax
import optax

from jaxcomm.ft._trainer import ReplicaState, _Trainer, as_vector
from jaxcomm.ft.group import Group
from jaxcomm.ft.replica import Replica


class DataParallel(_Trainer):
    """Fault-tolerant per-step gradient averaging (see the module docstring).

    Args:
      replica: this group's :class:`jaxcomm.ft.Replica`, or in a group of several
        processes its :class:`jaxcomm.ft.Group` (every rank passes its own).
      loss_fn: ``loss_fn(params, batch) -> scalar``.
      optimizer: the optax chain applied to the averaged gradient.
      wire_dtype: None (float32), "bfloat16" or "float16": what travels between groups.

    Example (``replica`` from :meth:`jaxcomm.ft.Group.from_env`)::

      trainer = DataParallel(replica, loss_fn, optax.adamw(3e-3), wire_dtype="bfloat16")
      state = trainer.start(params)
      while state.round < 1000:
          state, loss = trainer.step(state, batch_for(state.round, *trainer.shard()))
    """

    def __init__(
        self,
        replica: Replica | Group,
        loss_fn,
        optimizer: optax.GradientTransformation,
        *,
        wire_dtype=None,
    ):
        super().__init__(replica, loss_fn, wire_dtype=wire_dtype)
        self.optimizer = optimizer

        @jax.jit
        def apply(params, opt_state, mean):
            updates, opt_state = optimizer.update(mean, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._apply_mean = apply

    def start(self, params, *, batch=None) -> ReplicaState:
        """The starting state: ``params`` (equal on every group), or a live peer's committed one.

        Args:
          params: the initial params, the same on every group.
          batch: optional, a batch like the steps': compiles the step before this
            group joins, so that the others do not wait for it.
        """
        # Under jit, so that in a group of several processes every leaf spans them all.
        state = ReplicaState(params, jax.jit(self.optimizer.init)(params))
        return self._start(state, batch)

    def step(self, state: ReplicaState, batch) -> tuple[ReplicaState, jax.Array]:
        """One step: the gradient on ``batch``, averaged over the groups, applied if it commits."""
        loss, grads = self._grad(state.params, batch)
        r = self.group.sync(as_vector(grads), wire_dtype=self.wire_dtype)
        return self._finish(state, r), loss

    def _split(self, state):
        return (state.params, state.opt_state), ()

    def _join(self, shared, private, round_):
        params, opt_state = shared
        return ReplicaState(params, opt_state, round=round_)

    def _apply(self, state, mean):
        params, opt_state = self._apply_mean(state.params, state.opt_state, mean)
        return ReplicaState(params, opt_state, round=state.round + 1)

    def _warm_up(self, state, batch, mean):
        applied = self._apply_mean(state.params, state.opt_state, mean)
        return self._grad(state.params, batch), applied
