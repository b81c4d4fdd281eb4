"""The lighthouse: heartbeats, a quorum per round, and the commit vote.

One small server per job (``python -m jaxcomm.ft.lighthouse``, started by
``python -m jaxcomm.launch --replicas N``). Replica groups send it heartbeats
from a thread; at each round every group asks it for a quorum and, after the
exchange, votes on the outcome. It holds no training state: a restarted
lighthouse learns the members again from their next requests (it forms no
quorum for one heartbeat timeout, until every live group has been heard),
and numbers its quorums above every epoch they report having seen, so an
epoch is never reused.

Quorum rule: the quorum forms once every live group (a heartbeat within
``heartbeat_timeout``) is asking for one, or ``quorum_timeout`` after the first
asked. A slow group that still sends heartbeats is waited for; a frozen or dead
one drops out after ``heartbeat_timeout``, and the members of a round in
progress can ask which of them went silent (to abort their exchange without
waiting for its deadline). Vote rule: a round commits only if
every member of its quorum voted yes before the deadline; it is aborted as
soon as a member votes no, or one that has not voted stops sending
heartbeats. The decision is final and the same for every member that asks.
"""

from __future__ import annotations

import argparse
import socketserver
import threading
import time

from jaxcomm.ft import _messages

HEARTBEAT_TIMEOUT_S = 2.0
QUORUM_TIMEOUT_S = 60.0


class Lighthouse:
    """The coordinator of one job's replica groups (see the module docstring).

    Args:
      job_id: requests carrying another job id are refused.
      host, port: where to listen; loopback by default, port 0 picks a free one.
      heartbeat_timeout: seconds without a heartbeat after which a group is
        left out of the next quorum.
      quorum_timeout: seconds a quorum waits for live groups that do not ask.
      min_replicas: the fewest groups a quorum may have.
      replicas: groups the job starts with: while every group asking is at
        round 0 (the job's start), the quorum waits up to ``quorum_timeout``
        for this many, so that groups whose start-up is slow begin together.

    Example:
      >>> with Lighthouse("demo") as lighthouse:
      ...     host, port = lighthouse.address
    """

    def __init__(
        self,
        job_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
        quorum_timeout: float = QUORUM_TIMEOUT_S,
        min_replicas: int = 1,
        replicas: int = 1,
    ):
        if not job_id:
            raise ValueError("job_id must be a non-empty string")
        if min_replicas < 1:
            raise ValueError(f"min_replicas={min_replicas} must be at least 1")
        self.job_id = str(job_id)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.quorum_timeout = float(quorum_timeout)
        self.min_replicas = int(min_replicas)
        self.replicas = int(replicas)
        self.refused: list[str] = []
        self._cond = threading.Condition()
        self._seen: dict[int, float] = {}  # replica id -> last heartbeat (monotonic)
        self._asking: dict[int, dict] = {}  # replica id -> its quorum request
        self._first_ask = None
        self._epoch = 0
        self._formed: dict[int, dict] = {}  # replica id -> reply of the quorum it was put in
        self._members: dict[int, list[int]] = {}  # epoch -> member ids
        self._votes: dict[int, dict[int, bool]] = {}
        self._decided: dict[int, bool] = {}
        self._finished = None  # the round at which a group finished the job
        self._started = time.monotonic()
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                try:
                    message = _messages.recv_line(self.connection, self.rfile)
                    _messages.send_line(self.connection, outer.handle(message))
                except (OSError, ValueError):
                    pass  # the client went away; nothing to answer

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name="lighthouse"
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests ---------------------------------------------------------

    def handle(self, message: dict) -> dict:
        """The reply to one request (what the server sends back)."""
        if message.get("job_id") != self.job_id:
            who = f"{message.get('op')} from replica {message.get('replica_id')}"
            line = f"{who}: job id {message.get('job_id')!r}"
            self.refused.append(line)
            return {
                "error": f"refused: this lighthouse serves job {self.job_id!r}, "
                f"not {message.get('job_id')!r}"
            }
        op = message.get("op")
        rid = int(message["replica_id"])
        with self._cond:
            self._seen[rid] = time.monotonic()
            self._epoch = max(self._epoch, int(message.get("epoch_seen", 0)))
            self._cond.notify_all()
        if op == "heartbeat":
            return {"ok": True}
        if op == "leave":  # a group that is done: the next quorum does not wait for it
            with self._cond:
                self._seen.pop(rid, None)
                if message.get("finished"):
                    self._finished = max(self._finished or 0, int(message["committed_round"]))
                self._cond.notify_all()
            return {"ok": True}
        if op == "quorum":
            return self._quorum(rid, message)
        if op == "silent":  # members of an epoch that stopped sending heartbeats
            with self._cond:
                members = self._members.get(int(message["epoch"]), [])
                return {"silent": sorted(set(members) - self._live(time.monotonic()))}
        if op == "vote":
            return self._vote(
                rid, int(message["epoch"]), bool(message["ok"]), float(message["timeout"])
            )
        return {"error": f"unknown op {op!r}"}

    def _live(self, now: float) -> set[int]:
        return {r for r, t in self._seen.items() if now - t < self.heartbeat_timeout}

    def _quorum(self, rid: int, message: dict) -> dict:
        timeout = float(message.get("timeout", self.quorum_timeout + 5))
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._finished is not None and int(message["committed_round"]) < self._finished:
                # The job ended while this group was away: going on alone would fork its history.
                return {"finished": self._finished}
            self._formed.pop(rid, None)
            self._asking[rid] = message
            if self._first_ask is None:
                self._first_ask = time.monotonic()
            while rid not in self._formed:
                now = time.monotonic()
                if now >= deadline:
                    self._asking.pop(rid, None)
                    return {"error": f"no quorum within {timeout:.1f} s"}
                self._maybe_form(now)
                if rid not in self._formed:
                    self._cond.wait(timeout=min(0.05, deadline - now))
            return self._formed.pop(rid)

    def _maybe_form(self, now: float) -> None:
        if now - self._started < self.heartbeat_timeout:
            # A lighthouse that just (re)started has not heard every live group yet: a
            # quorum now could leave some out and let two quorums commit the same round.
            return
        asking = set(self._asking)
        waiting_for = self._live(now) - asking
        waited = now - self._first_ask
        starting = all(int(m["committed_round"]) == 0 for m in self._asking.values())
        too_few = len(asking) < self.min_replicas or (starting and len(asking) < self.replicas)
        if (too_few or waiting_for) and (
            waited < self.quorum_timeout or len(asking) < self.min_replicas
        ):
            return
        self._epoch += 1
        ids = sorted(asking)
        members = [
            {
                "replica_id": r,
                "address": self._asking[r]["address"],
                "state_address": self._asking[r]["state_address"],
                "committed_round": int(self._asking[r]["committed_round"]),
                "state_hash": self._asking[r]["state_hash"],
                "size": int(self._asking[r].get("size", 0)),
            }
            for r in ids
        ]
        reply = {"epoch": self._epoch, "members": members}
        self._members[self._epoch] = ids
        for r in ids:
            self._formed[r] = reply
        self._asking.clear()
        self._first_ask = None
        self._cond.notify_all()

    def _vote(self, rid: int, epoch: int, ok: bool, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            if epoch not in self._members:  # an epoch of a lighthouse before a restart
                return {"commit": False, "reason": f"epoch {epoch} unknown to this lighthouse"}
            self._votes.setdefault(epoch, {})[rid] = ok
            self._cond.notify_all()
            while epoch not in self._decided:
                votes = self._votes[epoch]
                missing = [r for r in self._members[epoch] if r not in votes]
                if not all(votes.values()):
                    self._decide(epoch, False)
                elif not missing:
                    self._decide(epoch, True)
                elif time.monotonic() >= deadline or set(missing) - self._live(time.monotonic()):
                    # Past the deadline, or a member that has not voted is dead or frozen:
                    # waiting for the deadline would only delay the same answer.
                    self._decide(epoch, False)
                else:
                    self._cond.wait(timeout=min(0.05, max(deadline - time.monotonic(), 0)))
            votes = self._votes[epoch]
            no = [r for r in self._members[epoch] if votes.get(r) is False]
            missing = [r for r in self._members[epoch] if r not in votes]
            return {"commit": self._decided[epoch], "no": no, "missing": missing}

    def _decide(self, epoch: int, commit: bool) -> None:
        self._decided[epoch] = commit
        for old in [e for e in self._members if e < epoch - 64]:  # bounded memory on long runs
            for table in (self._members, self._votes, self._decided):
                table.pop(old, None)
        self._cond.notify_all()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomm.ft.lighthouse", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--job-id", required=True)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (loopback by default)"
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S)
    parser.add_argument("--quorum-timeout", type=float, default=QUORUM_TIMEOUT_S)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=1, help="groups the job starts with")
    args = parser.parse_args(argv)
    lighthouse = Lighthouse(
        args.job_id,
        host=args.host,
        port=args.port,
        heartbeat_timeout=args.heartbeat_timeout,
        quorum_timeout=args.quorum_timeout,
        min_replicas=args.min_replicas,
        replicas=args.replicas,
    )
    host, port = lighthouse.address
    print(f"lighthouse for job {args.job_id} on {host}:{port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        lighthouse.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
