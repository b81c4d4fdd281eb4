"""DiLoCo across replica groups that come and go.

Each group runs ``inner`` on its own params for ``sync_every`` steps, then one
round averages the pseudo-gradients (global params minus local ones) over the
groups of the round's quorum and ``outer`` steps the global params with the
mean. A round that aborts costs the groups their inner steps since the last
commit: every group goes back to the committed global params and its own
committed inner state. A group that joins pulls the committed state from a
live peer and contributes from the next round on.
"""

from __future__ import annotations

import jax
import optax

from jaxcomm.ft._trainer import ReplicaState, _Trainer, as_vector
from jaxcomm.ft.group import Group
from jaxcomm.ft.replica import Replica


class DiLoCo(_Trainer):
    """Fault-tolerant DiLoCo over replica groups (see the module docstring).

    Args:
      replica: this group's :class:`jaxcomm.ft.Replica`, or in a group of several
        processes its :class:`jaxcomm.ft.Group` (every rank passes its own).
      loss_fn: ``loss_fn(params, batch) -> scalar``, differentiated at the group's local params.
      inner: the optax optimizer each group runs on its own gradients.
      outer: the optax optimizer of the averaged pseudo-gradient, e.g.
        ``optax.sgd(0.3, momentum=0.9, nesterov=True)``. Choose it for the
        smallest quorum faults leave: fewer groups average a noisier mean.
      sync_every: H, inner steps between rounds, >= 1.
      wire_dtype: None (float32), "bfloat16" or "float16": what travels between groups.

    Example (``replica`` from :meth:`jaxcomm.ft.Group.from_env`)::

      trainer = DiLoCo(replica, loss_fn, optax.adamw(3e-3),
                       optax.sgd(0.3, momentum=0.9, nesterov=True), sync_every=20)
      state = trainer.start(params)
      while state.round < 100:
          index, count = trainer.shard()
          state, loss = trainer.step(state, batch_for(state.round, state.step, index, count))
    """

    def __init__(
        self,
        replica: Replica | Group,
        loss_fn,
        inner: optax.GradientTransformation,
        outer: optax.GradientTransformation,
        *,
        sync_every: int,
        wire_dtype: str | None = None,
    ):
        super().__init__(replica, loss_fn, wire_dtype=wire_dtype)
        if int(sync_every) < 1:
            raise ValueError(f"sync_every={sync_every} must be at least 1")
        self.inner, self.outer, self.sync_every = inner, outer, int(sync_every)

        @jax.jit
        def inner_step(local, inner_state, batch):
            loss, grads = self._grad(local, batch)
            updates, inner_state = inner.update(grads, inner_state, local)
            return optax.apply_updates(local, updates), inner_state, loss

        @jax.jit
        def outer_step(params, outer_state, mean):
            updates, outer_state = outer.update(mean, outer_state, params)
            return optax.apply_updates(params, updates), outer_state

        self._inner_step, self._outer_step = inner_step, outer_step
        self._delta = jax.jit(lambda params, local: jax.tree.map(lambda g, x: g - x, params, local))

    def start(self, params, *, batch=None) -> ReplicaState:
        """The starting state: ``params`` (equal on every group), or a live peer's committed one.

        Args:
          params: the initial params, the same on every group.
          batch: optional, a batch like the steps': compiles the step and the round
            before this group joins, so that the others do not wait for it.
        """
        # Under jit, so that in a group of several processes every leaf spans them all.
        init = jax.jit(lambda p: (self.outer.init(p), self.inner.init(p)))
        outer_state, inner_state = init(params)
        state = ReplicaState(params, outer_state, params, inner_state, 0, 0)
        return self._start(state, batch)

    def step(self, state: ReplicaState, batch) -> tuple[ReplicaState, jax.Array]:
        """One inner step on ``batch``; every ``sync_every``-th also runs the round."""
        local, inner_state, loss = self._inner_step(state.local, state.inner_state, batch)
        state = state._replace(local=local, inner_state=inner_state, step=state.step + 1)
        if state.step >= self.sync_every:
            state = self.sync(state)
        return state, loss

    def sync(self, state: ReplicaState) -> ReplicaState:
        """The round: average the pseudo-gradients, commit and step, or roll back."""
        r = self.group.sync(
            as_vector(self._delta(state.params, state.local)), wire_dtype=self.wire_dtype
        )
        return self._finish(state, r)._replace(step=0)

    def _split(self, state):
        return (state.params, state.opt_state), state.inner_state

    def _join(self, shared, private, round_):
        params, outer_state = shared
        return ReplicaState(params, outer_state, params, private, round_, 0)

    def _apply(self, state, mean):
        params, outer_state = self._outer_step(state.params, state.opt_state, mean)
        return ReplicaState(params, outer_state, params, state.inner_state, state.round + 1, 0)

    def _warm_up(self, state, batch, mean):
        local, _, loss = self._inner_step(state.local, state.inner_state, batch)
        outer = self._outer_step(state.params, state.opt_state, mean)
        return loss, self._delta(state.params, local), outer
