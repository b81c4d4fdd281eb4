"""What the fault-tolerant trainers share: state on the host, joining, rolling back.

A trainer keeps two trees in a :class:`~jaxcomm.ft.snapshot.Snapshot`:
``shared`` (equal on every member after a commit) and ``private`` (this
group's own). :meth:`_Trainer._finish` turns a :class:`~jaxcomm.ft.replica.Round`
into the next state: load what a joiner pulled, apply a committed mean and
commit, or restore the last commit after an abort.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from jaxcomm.ft.replica import Replica, Round
from jaxcomm.ft.snapshot import Snapshot

WIRE_DTYPES = (None, "bfloat16", "float16")


class ReplicaState(NamedTuple):
    """A replica group's training state.

    Attributes:
      params: the params of the last committed round, the same on every live
        group (DiLoCo's global params; evaluate these).
      opt_state: the optimizer state that goes with them (DiLoCo: the outer one).
      local: DiLoCo: this group's params, moved by its inner steps; else ``None``.
      inner_state: DiLoCo: the inner optimizer's state; else ``None``.
      round: committed rounds (the data position: batches follow it).
      step: DiLoCo: inner steps since the last round; else 0.
    """

    params: Any
    opt_state: Any
    local: Any = None
    inner_state: Any = None
    round: int = 0
    step: int = 0


class RoundLog(NamedTuple):
    """One round as this group saw it (``trainer.log``); what the fault harness reads."""

    round: int
    committed: bool
    epoch: int
    members: tuple
    contributors: int
    healed: bool
    state_hash: str
    seconds: float
    reason: str
    time: float


class _Trainer:
    def __init__(self, replica: Replica, loss_fn, *, wire_dtype):
        if not isinstance(replica, Replica):
            raise TypeError(f"replica must be a jaxcomm.ft.Replica, got {type(replica).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be a function loss_fn(params, batch) -> scalar")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype={wire_dtype!r} must be one of {WIRE_DTYPES}")
        self.replica = replica
        self.wire_dtype = wire_dtype
        self.log: list[RoundLog] = []
        self._grad = jax.jit(jax.value_and_grad(loss_fn))
        self._trees = None  # (shared treedef, private treedef)

    def shard(self) -> tuple[int, int]:
        """(index, count) of this group among the last quorum's: its share of the data."""
        return self.replica.shard()

    # -- state on the host ---------------------------------------------------

    def _snapshot(self, state: ReplicaState) -> Snapshot:
        shared, private = self._split(state)
        host = jax.device_get((jax.tree.leaves(shared), jax.tree.leaves(private)))
        return Snapshot(
            state.round, tuple(map(np.asarray, host[0])), tuple(map(np.asarray, host[1]))
        )

    def _load(self, snap: Snapshot) -> ReplicaState:
        shared_def, private_def = self._trees
        shared = jax.tree.unflatten(shared_def, [jnp.asarray(a) for a in snap.shared])
        private = jax.tree.unflatten(private_def, [jnp.asarray(a) for a in snap.private])
        return self._join(shared, private, snap.round)

    def _start(self, state: ReplicaState) -> ReplicaState:
        """Commits the starting state, then joins: pulls a live peer's state if it differs."""
        shared, private = self._split(state)
        self._trees = (jax.tree.structure(shared), jax.tree.structure(private))
        self._vector, self._unravel = ravel_pytree(state.params)
        self._unravel = jax.jit(self._unravel)
        self.replica.commit(self._snapshot(state))
        nothing = np.zeros(self._vector.size, np.float32)
        while True:  # a join round aborted by a fault elsewhere is simply tried again
            r = self.replica.sync(nothing, contributes=False, wire_dtype=self.wire_dtype)
            state = self._finish(state, r)
            if r.committed:
                return state

    def _finish(self, state: ReplicaState, r: Round) -> ReplicaState:
        if r.healed is not None:
            state = self._load(r.healed)
        if r.committed and r.mean is not None:
            state = self._apply(state, self._unravel(jnp.asarray(r.mean)))
            self.replica.commit(self._snapshot(state))
        elif not r.committed:
            state = self._load(self.replica.committed)
        self.log.append(
            RoundLog(
                state.round,
                r.committed,
                r.epoch,
                r.members,
                r.contributors,
                r.healed is not None,
                self.replica.state_hash,
                r.seconds,
                r.reason,
                time.time(),
            )
        )
        return state

    # -- what each trainer defines --------------------------------------------

    def _split(self, state: ReplicaState) -> tuple[Any, Any]:
        raise NotImplementedError

    def _join(self, shared, private, round_: int) -> ReplicaState:
        raise NotImplementedError

    def _apply(self, state: ReplicaState, mean) -> ReplicaState:
        raise NotImplementedError


def as_vector(tree) -> np.ndarray:
    """A pytree as one float32 host vector (ravel_pytree's order)."""
    flat, _ = ravel_pytree(tree)
    return np.asarray(jax.device_get(flat), dtype=np.float32)
