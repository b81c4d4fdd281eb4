"""One replica group's side of fault tolerance: heartbeats, rounds, healing.

A :class:`Replica` lives in each replica group (the process that drives it:
rank 0 of the group's own JAX job, or its only process). It sends the
lighthouse heartbeats from a thread, serves its last committed
:class:`~jaxcomm.ft.snapshot.Snapshot` to joiners, and runs rounds:

1. ask the lighthouse for a quorum (every live group, one new epoch);
2. if this group is behind the quorum's most advanced committed round, or its
   state hashes differently, pull that state from a member that has it and
   check it against the hash those members reported (*healing*);
3. sum ``[weight * x, weight]`` over the quorum with a deadline (jaxcomm's host
   exchange, :mod:`jaxcomm.ft.exchange`); a healed group sends weight 0, so the
   mean is over the groups that computed a contribution;
4. vote; the round commits only if every member's exchange succeeded.

The caller applies a committed mean and records the new state with
:meth:`Replica.commit`; after an aborted round it restores its last commit.
The protocol and its failure cases: docs/fault_tolerance.md.
"""

from __future__ import annotations

import os
import socketserver
import threading
import time
from typing import NamedTuple

import numpy as np

from jaxcomm.distributed.startup import ENV_PROCESS_ID
from jaxcomm.ft import _messages
from jaxcomm.ft.exchange import Endpoint, ExchangeAborted, Member
from jaxcomm.ft.snapshot import Snapshot

TIMEOUT_S = 10.0
HEARTBEAT_INTERVAL_S = 0.25
WATCH_S = 0.5  # how often a running exchange asks the lighthouse for silent members


class JobFinished(RuntimeError):
    """The job finished (a group left it done) at a round this group does not hold."""


class Round(NamedTuple):
    """What one round did on this member.

    Attributes:
      committed: the round committed on every member (else it was aborted everywhere).
      mean: the mean of the contributions (float32 vector), ``None`` when
        aborted or when no member contributed.
      epoch: the quorum's epoch.
      members: replica ids in the quorum, sorted.
      contributors: how many members' contributions ``mean`` averages.
      healed: the snapshot this member pulled and must load first, or ``None``.
      reason: why it aborted ("" when committed).
      seconds: wall time of the round, quorum included.
    """

    committed: bool
    mean: np.ndarray | None
    epoch: int
    members: tuple
    contributors: int
    healed: Snapshot | None
    reason: str
    seconds: float


class Replica:
    """This replica group's connection to its job (see the module docstring).

    Args:
      lighthouse: ``"host:port"`` of the job's lighthouse.
      replica_id: this group's id in the job, an int >= 0.
      job_id: the job's id; a lighthouse or peer of another job is refused.
      host: where this group's exchange and state server listen (loopback by default).
      timeout: seconds from the quorum to the end of the vote; a round not done
        by then is aborted everywhere.
      quorum_timeout: seconds to keep asking for a quorum (the lighthouse may be
        restarting) before raising.
      on_phase: ``on_phase(phase, round)``, called as a round enters "exchange"
        and "vote"; a fault-injection harness kills or stops the process there.

    Example (with a lighthouse running; ``python -m jaxcomm.launch --replicas N``
    starts one and sets the environment :meth:`from_env` reads):

      >>> from jaxcomm.ft import Lighthouse, Replica
      >>> lighthouse = Lighthouse("demo")
      >>> host, port = lighthouse.address
      >>> replica = Replica(f"{host}:{port}", replica_id=0, job_id="demo")
      >>> replica.close(); lighthouse.close()
    """

    def __init__(
        self,
        lighthouse: str,
        *,
        replica_id: int,
        job_id: str,
        host: str = "127.0.0.1",
        timeout: float = TIMEOUT_S,
        quorum_timeout: float = 120.0,
        on_phase=None,
    ):
        if int(replica_id) < 0:
            raise ValueError(f"replica_id={replica_id} must be >= 0")
        self.lighthouse = _messages.parse_address(lighthouse)
        self.replica_id = int(replica_id)
        self.job_id = str(job_id)
        self.timeout = float(timeout)
        self.quorum_timeout = float(quorum_timeout)
        self._on_phase = on_phase or (lambda phase, round_: None)
        self.committed: Snapshot | None = None
        self._hash = ""
        self._epoch_seen = 0
        self._last_members: tuple = (self.replica_id,)
        self._closed = threading.Event()
        self.endpoint = Endpoint(self.job_id, self.replica_id, host=host)
        self._state_server = _state_server(self, host)
        threading.Thread(
            target=self._state_server.serve_forever, daemon=True, name="ft-state"
        ).start()
        self._heartbeats = threading.Thread(target=self._beat, daemon=True, name="ft-heartbeat")
        self._heartbeats.start()

    @classmethod
    def from_env(cls, **kwargs) -> Replica:
        """The replica ``python -m jaxcomm.launch --replicas N`` describes in the environment.

        Reads ``JAXCOMM_FT_LIGHTHOUSE``, ``JAXCOMM_FT_REPLICA_ID`` and
        ``JAXCOMM_FT_JOB_ID``; ``kwargs`` go to the constructor. In a group of
        several processes (``-n M``) only rank 0 has one: call
        :meth:`jaxcomm.ft.Group.from_env` on every rank instead.
        """
        rank = os.environ.get(ENV_PROCESS_ID, "0")
        if rank != "0":
            raise RuntimeError(
                f"this process is rank {rank} of its replica group, and only rank 0 holds "
                "the group's Replica: call jaxcomm.ft.Group.from_env() on every rank"
            )
        missing = [
            k
            for k in ("JAXCOMM_FT_LIGHTHOUSE", "JAXCOMM_FT_REPLICA_ID", "JAXCOMM_FT_JOB_ID")
            if k not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)} not set: start this script with "
                "python -m jaxcomm.launch --replicas N"
            )
        return cls(
            os.environ["JAXCOMM_FT_LIGHTHOUSE"],
            replica_id=int(os.environ["JAXCOMM_FT_REPLICA_ID"]),
            job_id=os.environ["JAXCOMM_FT_JOB_ID"],
            **kwargs,
        )

    def close(self, *, finished: bool = False) -> None:
        """Leaves the job: stops the heartbeats, tells the lighthouse, closes the sockets.

        Args:
          finished: this group reached the end of training. A group that comes
            back later, behind this group's committed round, then gets
            :class:`JobFinished` instead of training on alone.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        self._heartbeats.join(timeout=2.0)
        message = self._message("leave")
        message["finished"] = bool(finished)
        message["committed_round"] = -1 if self.committed is None else int(self.committed.round)
        try:
            _messages.request(self.lighthouse, message, timeout=1.0)
        except _messages.Unreachable:
            pass  # the lighthouse is gone or restarting; the heartbeat timeout does the same
        self.endpoint.close()
        self._state_server.shutdown()
        self._state_server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def shard(self) -> tuple[int, int]:
        """(this group's index, group count) in the last quorum: its data shard."""
        members = self._last_members
        return members.index(self.replica_id), len(members)

    @property
    def state_hash(self) -> str:
        """Hash of the committed state (:meth:`Snapshot.hash`), "" before the first commit."""
        return self._hash

    def commit(self, snapshot: Snapshot) -> None:
        """Records ``snapshot`` as this group's committed state, served to joiners."""
        self._hash = snapshot.hash()
        self.committed = snapshot

    # -- one round --------------------------------------------------------

    def sync(
        self, contribution: np.ndarray, *, contributes: bool = True, wire_dtype: str | None = None
    ) -> Round:
        """Runs one round with ``contribution`` (see the module docstring).

        Args:
          contribution: 1-D float32, the same length on every member.
          contributes: False to take part with weight 0 (joining, or nothing computed).
          wire_dtype: None, "bfloat16" or "float16": what travels between groups.

        Returns:
          A :class:`Round`. Never raises for a failed peer: that is an aborted round.

        Raises:
          JobFinished: the job ended at a round this group does not hold.
        """
        if self.committed is None:
            raise RuntimeError(
                "Replica.sync before Replica.commit: commit the starting state first"
            )
        x = np.asarray(contribution)
        if x.ndim != 1 or x.dtype != np.float32:
            raise ValueError(f"contribution must be a 1-D float32 vector, got {x.dtype}{x.shape}")
        start = time.monotonic()
        quorum = self._quorum(x.size)
        epoch = int(quorum["epoch"])
        self._epoch_seen = max(self._epoch_seen, epoch)
        members = quorum["members"]
        ids = tuple(int(m["replica_id"]) for m in members)
        self._last_members = ids
        sizes = {int(m["size"]) for m in members}
        deadline = time.monotonic() + self.timeout
        top = max(int(m["committed_round"]) for m in members)
        hashes = [m["state_hash"] for m in members if int(m["committed_round"]) == top]
        reference = max(set(hashes), key=lambda h: (hashes.count(h), h))
        healthy = [
            m for m in members if int(m["committed_round"]) == top and m["state_hash"] == reference
        ]
        healed, reason = None, ""
        if len(sizes) > 1:
            reason = f"contributions differ in length between members: {sorted(sizes)}"
        elif (self.committed.round, self._hash) != (top, reference):
            healed, reason = self._heal(healthy, top, reference, deadline, epoch)
            contributes = False
        total = None
        self._on_phase("exchange", top + 1)
        if not reason:
            weight = np.float32(1.0 if contributes else 0.0)
            # Zeros, not x * 0: a healer's stale contribution may hold infs or NaNs.
            sent = x if contributes else np.zeros_like(x)
            payload = np.concatenate([sent, np.array([weight], np.float32)])
            peers = [Member(int(m["replica_id"]), *m["address"]) for m in members]
            watch = _Watch(self, epoch)
            try:
                total = self.endpoint.allreduce_sum(
                    payload,
                    epoch=epoch,
                    round=top + 1,
                    members=peers,
                    deadline=deadline,
                    wire_dtype=wire_dtype,
                )
            except ExchangeAborted as e:
                reason = f"exchange: {watch.silent or e}"
            finally:
                watch.stop()
        self._on_phase("vote", top + 1)
        commit, vote_reason = self._vote(epoch, ok=not reason, deadline=deadline)
        reason = reason or vote_reason
        mean, count = None, 0
        if commit and total is not None and total[-1] > 0:
            count = int(round(float(total[-1])))
            mean = total[:-1] / total[-1]
        return Round(
            commit,
            mean,
            epoch,
            ids,
            count,
            healed,
            "" if commit else reason,
            time.monotonic() - start,
        )

    def _message(self, op: str, **fields) -> dict:
        """A request to the lighthouse: the op, this job and group, and ``fields``."""
        return {"op": op, "job_id": self.job_id, "replica_id": self.replica_id, **fields}

    def _quorum(self, size: int) -> dict:
        message = self._message(
            "quorum",
            epoch_seen=self._epoch_seen,
            address=list(self.endpoint.address),
            state_address=list(self._state_server.server_address[:2]),
            committed_round=int(self.committed.round),
            state_hash=self._hash,
            size=int(size),
            timeout=self.quorum_timeout,
        )
        deadline = time.monotonic() + self.quorum_timeout
        last = "nothing"
        while time.monotonic() < deadline:
            try:
                reply = _messages.request(
                    self.lighthouse, message, timeout=deadline - time.monotonic() + 1
                )
            except _messages.Unreachable as e:  # a restarting lighthouse: ask again
                last = str(e)
                time.sleep(0.2)
                continue
            if "error" in reply:
                raise RuntimeError(
                    f"lighthouse {self.lighthouse[0]}:{self.lighthouse[1]}: {reply['error']}"
                )
            if "finished" in reply:
                raise JobFinished(
                    f"the job finished at round {reply['finished']} while replica group "
                    f"{self.replica_id} was away (it holds round {self.committed.round}); "
                    "nothing is left to train"
                )
            return reply
        raise RuntimeError(
            f"no quorum from the lighthouse within {self.quorum_timeout:.0f} s (last: {last})"
        )

    def _heal(
        self, healthy: list, top: int, reference: str, deadline: float, epoch: int
    ) -> tuple[Snapshot | None, str]:
        """Pulls round ``top``'s state from a healthy member; (snapshot, "") or (None, why not)."""
        order = sorted(healthy, key=lambda m: (int(m["replica_id"]) - self.replica_id) % 1_000_003)
        errors = []
        for m in order:
            message = {"op": "state", "job_id": self.job_id, "round": top}
            try:
                header, body = _messages.request(
                    tuple(m["state_address"]),
                    message,
                    timeout=max(deadline - time.monotonic(), 0.1),
                    payload=True,
                    # A member frozen since the quorum would hold this group to the deadline.
                    alive=lambda rid=int(m["replica_id"]): rid not in self._silent(epoch),
                )
                if "error" in header:
                    raise ValueError(header["error"])
                snap = Snapshot.decode(header, body)
                if snap.hash() != reference:
                    raise ValueError(
                        f"state hashes to {snap.hash()}, the quorum's members reported {reference}"
                    )
            except (_messages.Unreachable, ValueError, KeyError) as e:
                errors.append(f"replica {m['replica_id']}: {e}")
                continue
            self.commit(snap)
            return snap, ""
        return None, "healing failed: " + "; ".join(errors)

    def _silent(self, epoch: int) -> list:
        """Members of ``epoch`` that stopped sending heartbeats ([] if the lighthouse is away)."""
        try:
            reply = _messages.request(
                self.lighthouse, self._message("silent", epoch=epoch), timeout=1.0
            )
        except _messages.Unreachable:
            return []  # the deadline still holds
        return reply.get("silent") or []

    def _vote(self, epoch: int, *, ok: bool, deadline: float) -> tuple[bool, str]:
        message = self._message("vote", epoch=epoch, ok=ok)
        message["timeout"] = max(deadline - time.monotonic(), 0.0)
        try:
            reply = _messages.request(self.lighthouse, message, timeout=message["timeout"] + 2.0)
        except _messages.Unreachable as e:
            return False, f"vote: lighthouse unreachable ({e})"
        if "error" in reply:
            return False, f"vote: {reply['error']}"
        if reply["commit"]:
            return True, ""
        return False, reply.get(
            "reason"
        ) or f"vote: no from {reply.get('no')}, missing {reply.get('missing')}"

    def _beat(self) -> None:
        while True:
            message = self._message("heartbeat", epoch_seen=self._epoch_seen)
            try:
                _messages.request(self.lighthouse, message, timeout=1.0)
            except _messages.Unreachable:
                pass  # the lighthouse may be restarting; the next beat tries again
            if self._closed.wait(HEARTBEAT_INTERVAL_S):
                return


class _Watch:
    """While an exchange runs, asks the lighthouse every ``WATCH_S`` whether a member
    went silent (no heartbeats: dead, frozen or cut off) and aborts the exchange if
    one did. A frozen member would otherwise hold the others until the deadline;
    a slow one still sends heartbeats and is waited for."""

    def __init__(self, replica: Replica, epoch: int):
        self.silent = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(replica, epoch), daemon=True, name="ft-watch"
        )
        self._thread.start()

    def _run(self, replica: Replica, epoch: int):
        while not self._stop.wait(WATCH_S):
            silent = replica._silent(epoch)
            if silent:
                self.silent = f"replica(s) {silent} stopped sending heartbeats; aborted"
                replica.endpoint.abort()
                return

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=2.0)


def _state_server(replica: Replica, host: str) -> socketserver.ThreadingTCPServer:
    """Serves ``replica.committed`` to joiners of the same job."""

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            try:
                message = _messages.recv_line(self.connection, self.rfile)
                snap = replica.committed
                if message.get("job_id") != replica.job_id:
                    reply, body = (
                        {"error": f"refused: another job ({message.get('job_id')!r})"},
                        b"",
                    )
                elif snap is None or snap.round != int(message.get("round", -1)):
                    have = None if snap is None else snap.round
                    reply, body = {"error": f"have round {have}, not {message.get('round')}"}, b""
                else:
                    reply, body = snap.encode()
                _messages.send_line(self.connection, reply)
                self.connection.sendall(body)
            except (OSError, ValueError):
                pass

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True

    return Server((host, 0), Handler)
