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
from jax.experimental import multihost_utils

from jaxcomm.ft.group import Group
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
    def __init__(self, replica: Replica | Group, loss_fn, *, wire_dtype):
        if isinstance(replica, Replica):
            replica = Group(replica)
        if not isinstance(replica, Group):
            raise TypeError(
                f"replica must be a jaxcomm.ft.Replica or Group, got {type(replica).__name__}"
            )
        if not callable(loss_fn):
            raise TypeError("loss_fn must be a function loss_fn(params, batch) -> scalar")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype={wire_dtype!r} must be one of {WIRE_DTYPES}")
        self.group = replica
        self.wire_dtype = wire_dtype
        self.log: list[RoundLog] = []
        self._grad = jax.jit(jax.value_and_grad(loss_fn))
        self._like = None  # _Layout of the starting state's (shared, private, params)

    def shard(self) -> tuple[int, int]:
        """(index, count) of this group among the last quorum's: its share of the data."""
        return self.group.shard()

    # -- state on the host ---------------------------------------------------

    def _snapshot(self, state: ReplicaState) -> Snapshot:
        shared, private = self._split(state)
        return Snapshot(state.round, tuple(host_leaves(shared)), tuple(host_leaves(private)))

    def _load(self, snap: Snapshot) -> ReplicaState:
        shared, private, _ = self._like
        return self._join(shared.place(snap.shared), private.place(snap.private), snap.round)

    def _start(self, state: ReplicaState, batch=None) -> ReplicaState:
        """Commits the starting state, then joins: pulls a live peer's state if it differs."""
        shared, private = self._split(state)
        self._like = (_Layout(shared), _Layout(private), _Layout(state.params))
        snapshot = self._snapshot(state)
        # Placed from the host, as a heal or a rollback places it (committed to its
        # devices): the steps compile for these arrays once, not again after a heal.
        state = self._load(snapshot)
        if jax.process_count() > 1:  # the warm-up's collectives span the group's ranks
            multihost_utils.assert_equal(
                np.array(batch is not None),
                "trainer.start(batch=...) must be given on every rank of the group, or on none",
            )
        params = self._like[2]
        nothing = np.zeros(params.size, np.float32)
        if batch is not None:
            # Before this group's first quorum: a group that restarts would otherwise
            # compile its first step while the other groups' next round waits for it.
            mean = params.place(params.split(nothing))
            jax.block_until_ready(self._warm_up(state, batch, mean))
        self.group.commit(snapshot)
        while True:  # a join round aborted by a fault elsewhere is simply tried again
            r = self.group.sync(nothing, contributes=False, wire_dtype=self.wire_dtype)
            state = self._finish(state, r)
            if r.committed:
                return state

    def _finish(self, state: ReplicaState, r: Round) -> ReplicaState:
        if r.healed is not None:
            state = self._load(r.healed)
        if r.committed and r.mean is not None:
            params = self._like[2]
            state = self._apply(state, params.place(params.split(r.mean)))
            self.group.commit(self._snapshot(state))
        elif not r.committed:
            state = self._load(self.group.committed)
        self.log.append(
            RoundLog(
                state.round,
                r.committed,
                r.epoch,
                r.members,
                r.contributors,
                r.healed is not None,
                self.group.state_hash,
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

    def _warm_up(self, state: ReplicaState, batch, mean) -> Any:
        """Runs each jitted function of a step and a round once; returns their outputs."""
        raise NotImplementedError


def host_leaves(tree) -> list[np.ndarray]:
    """The leaves of ``tree`` on the host, whole, in ``jax.tree.leaves`` order.

    A leaf sharded over the processes of a group is gathered from them, so every
    rank of the group must call this at the same point.
    """
    out = []
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            if a.is_fully_replicated:
                a = a.addressable_data(0)
            else:
                a = multihost_utils.process_allgather(a, tiled=True)
        out.append(a)
    return [np.asarray(a) for a in jax.device_get(out)]


def as_vector(tree) -> np.ndarray:
    """A pytree as one float32 host vector (``jax.flatten_util.ravel_pytree``'s order)."""
    leaves = host_leaves(tree)
    if not leaves:
        return np.zeros(0, np.float32)
    return np.concatenate([np.ravel(a).astype(np.float32) for a in leaves])


class _Layout:
    """A tree's structure and its leaves' shapes, dtypes and placements."""

    def __init__(self, tree):
        leaves, self.treedef = jax.tree.flatten(tree)
        self.shapes = [np.shape(a) for a in leaves]
        self.dtypes = [a.dtype if hasattr(a, "dtype") else np.result_type(a) for a in leaves]
        self.shardings = [a.sharding if isinstance(a, jax.Array) else None for a in leaves]
        self.size = int(sum(np.prod(s, dtype=np.int64) for s in self.shapes))

    def split(self, vector: np.ndarray) -> list[np.ndarray]:
        """A flat vector (as :func:`as_vector` makes) cut into this tree's leaves and dtypes."""
        ends = np.cumsum([int(np.prod(s, dtype=np.int64)) for s in self.shapes])
        parts = np.split(np.asarray(vector), ends[:-1])
        leaves = zip(parts, self.shapes, self.dtypes, strict=True)
        return [p.reshape(s).astype(d) for p, s, d in leaves]

    def place(self, arrays):
        """Host ``arrays`` (in leaf order) as this tree, each placed as its leaf was."""
        leaves = [
            jnp.asarray(a)
            if s is None
            else jax.make_array_from_callback(np.shape(a), s, lambda i, a=a: np.asarray(a)[i])
            for a, s in zip(arrays, self.shardings, strict=True)
        ]
        return jax.tree.unflatten(self.treedef, leaves)
