"""A replica group of one process or several: its Replica on rank 0, followed by the rest.

A replica group may be its own ``jax.distributed`` job over its fast links
(``python -m jaxcomm.launch --replicas N -n M``): M processes whose arrays span
them all. Only one of them talks to the other groups: rank 0 holds the group's
:class:`~jaxcomm.ft.replica.Replica` (heartbeats, exchange, state server).
:class:`Group` is what a trainer drives on every rank: on rank 0 it runs the
round and broadcasts its outcome (:class:`~jaxcomm.ft.replica.Round`, the shard,
a healed snapshot, or the error) inside the group; on the other ranks it
receives that outcome. Every rank then applies the same mean to the same
arrays, so a group commits or rolls back as one.

A rank that dies takes its group with it (JAX's runtime is fate-sharing inside
a job); the launcher restarts the whole group and it heals from a peer group.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxcomm.distributed.startup import ENV_NUM_PROCESSES
from jaxcomm.ft.replica import JobFinished, Replica, Round
from jaxcomm.ft.snapshot import Snapshot


class Group:
    """This process's side of its replica group (see the module docstring).

    Args:
      replica: the group's :class:`Replica` on rank 0 (the only rank of a
        one-process group); ``None`` on the other ranks.
      replica_id: the group's id; defaults to ``replica.replica_id``.

    Example (a one-process group; under ``python -m jaxcomm.launch --replicas N -n M``
    every rank calls :meth:`from_env` and passes the result to a trainer):

      >>> from jaxcomm.ft import Group, Lighthouse, Replica
      >>> lighthouse = Lighthouse("demo")
      >>> host, port = lighthouse.address
      >>> group = Group(Replica(f"{host}:{port}", replica_id=0, job_id="demo"))
      >>> group.replica_id, group.leads
      (0, True)
      >>> group.close(); lighthouse.close()
    """

    def __init__(self, replica: Replica | None, *, replica_id: int | None = None):
        if replica is not None and not isinstance(replica, Replica):
            raise TypeError(f"replica must be a jaxcomm.ft.Replica or None, got {replica!r}")
        if replica is None and replica_id is None:
            raise ValueError("a rank without the group's Replica must be given replica_id")
        if replica is None and _single_process():
            raise ValueError(
                "replica is None, but this process is alone in its JAX job: "
                "a one-process group's only rank holds its Replica"
            )
        self.replica = replica
        self.replica_id = int(replica.replica_id if replica_id is None else replica_id)
        self._committed: Snapshot | None = None
        self._hash = ""
        self._shard = (0, 1)

    @classmethod
    def from_env(cls, **kwargs) -> Group:
        """The group ``python -m jaxcomm.launch --replicas N [-n M]`` describes.

        Call it after ``jaxcomm.distributed.initialize()`` in a group of several
        processes. Rank 0 (``jax.process_index()``) builds the Replica with
        :meth:`Replica.from_env`, to which ``kwargs`` go; the other ranks follow.
        """
        processes = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
        if processes > 1 and jax.process_count() == 1:
            raise RuntimeError(
                f"this replica group has {processes} processes ({ENV_NUM_PROCESSES}), but "
                "JAX sees only this one: call jaxcomm.distributed.initialize() before "
                "Group.from_env()"
            )
        if jax.process_index() == 0:
            return cls(Replica.from_env(**kwargs))
        if "JAXCOMM_FT_REPLICA_ID" not in os.environ:
            raise RuntimeError(
                "JAXCOMM_FT_REPLICA_ID not set: start this script with "
                "python -m jaxcomm.launch --replicas N -n M"
            )
        return cls(None, replica_id=int(os.environ["JAXCOMM_FT_REPLICA_ID"]))

    @property
    def leads(self) -> bool:
        """True on the rank that holds the Replica."""
        return self.replica is not None

    @property
    def committed(self) -> Snapshot | None:
        """The last committed state (every rank holds it, for rolling back)."""
        return self._committed

    @property
    def state_hash(self) -> str:
        """Hash of the committed state (:meth:`Snapshot.hash`), "" before the first commit."""
        return self._hash

    def shard(self) -> tuple[int, int]:
        """(this group's index, group count) in the last quorum: its data shard."""
        return self._shard

    def commit(self, snapshot: Snapshot) -> None:
        """Records ``snapshot`` as the group's committed state (served by rank 0)."""
        if self.leads:
            self.replica.commit(snapshot)
            self._hash = self.replica.state_hash
        else:
            self._hash = snapshot.hash()
        self._committed = snapshot

    def sync(self, contribution: np.ndarray, *, contributes: bool = True, wire_dtype=None) -> Round:
        """Rank 0 runs :meth:`Replica.sync`; every rank returns its :class:`Round`.

        Every rank passes the group's whole contribution (only rank 0's is
        sent). Raises on every rank what rank 0's round raised.
        """
        if _single_process():  # nothing to broadcast
            r = self.replica.sync(contribution, contributes=contributes, wire_dtype=wire_dtype)
            self._shard = self.replica.shard()
        else:
            outcome, error = None, None
            if self.leads:
                try:
                    r = self.replica.sync(
                        contribution, contributes=contributes, wire_dtype=wire_dtype
                    )
                    outcome = _encode(r, self.replica.shard())
                except Exception as e:  # noqa: BLE001 - the other ranks raise it too, below
                    error = e
                    outcome = _frame({"error": type(e).__name__, "message": str(e)}, b"")
            payload = _broadcast(outcome)
            if error is not None:
                raise error
            r, self._shard = _decode(payload)
        if r.healed is not None:  # the Replica committed it on rank 0
            self._committed = r.healed
            self._hash = self.replica.state_hash if self.leads else r.healed.hash()
        return r

    def close(self, *, finished: bool = False) -> None:
        """Rank 0 leaves the job (:meth:`Replica.close`); a no-op on the other ranks."""
        if self.leads:
            self.replica.close(finished=finished)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _single_process() -> bool:
    return jax.process_count() == 1


def _encode(r: Round, shard: tuple[int, int]) -> bytes:
    header = {
        "committed": r.committed,
        "epoch": r.epoch,
        "members": list(r.members),
        "contributors": r.contributors,
        "reason": r.reason,
        "seconds": r.seconds,
        "shard": list(shard),
        "mean": None if r.mean is None else int(r.mean.size),
        "healed": None,
    }
    body = b"" if r.mean is None else np.asarray(r.mean, np.float32).tobytes()
    if r.healed is not None:
        snap_header, snap_body = r.healed.encode()
        header["healed"] = snap_header
        body += snap_body
    return _frame(header, body)


def _frame(header: dict, body: bytes) -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + body


def _decode(payload: bytes) -> tuple[Round, tuple[int, int]]:
    n = int.from_bytes(payload[:8], "little")
    header, body = json.loads(payload[8 : 8 + n]), memoryview(payload)[8 + n :]
    if "error" in header:
        if header["error"] == "JobFinished":
            raise JobFinished(header["message"])
        raise RuntimeError(f"rank 0 of this replica group: {header['error']}: {header['message']}")
    mean, healed = None, None
    if header["mean"] is not None:
        k = 4 * int(header["mean"])
        mean, body = np.frombuffer(bytes(body[:k]), np.float32).copy(), body[k:]
    if header["healed"] is not None:
        healed = Snapshot.decode(header["healed"], body)
    r = Round(
        bool(header["committed"]),
        mean,
        int(header["epoch"]),
        tuple(header["members"]),
        int(header["contributors"]),
        healed,
        header["reason"],
        float(header["seconds"]),
    )
    return r, tuple(header["shard"])


def _broadcast(payload: bytes | None) -> bytes:
    """Rank 0's ``payload`` (``None`` on the other ranks) on every rank of this JAX job."""
    size = np.array([0 if payload is None else len(payload)], np.int64)
    (size,) = multihost_utils.broadcast_one_to_all((size,))
    n = int(size[0])
    # Padded to a power of two (few compiled broadcasts) and sent as int32: a sum of
    # rank 0's words and zeros is exact in integers.
    padded = max(4, 1 << max(n - 1, 0).bit_length())
    buf = np.zeros(padded, np.uint8)
    if payload is not None:
        buf[:n] = np.frombuffer(payload, np.uint8)
    (words,) = multihost_utils.broadcast_one_to_all((buf.view(np.int32),))
    return np.asarray(words).view(np.uint8)[:n].tobytes()
