"""Fault injection for the fault-tolerance tests and benches.

A plan is a JSON list of faults, each for one replica group, one incarnation
of it (0 at first start, +1 per restart) and one round::

    [{"replica": 1, "incarnation": 0, "round": 4, "phase": "exchange", "action": "kill"},
     {"replica": 2, "incarnation": 0, "round": 7, "phase": "inner", "action": "stop",
      "seconds": 14}]

``phase`` is "inner" (halfway through the round's inner steps), "exchange"
(the quorum is formed, the exchange about to start) or "vote" (the exchange
done, the vote not cast). ``action`` is "kill" (SIGKILL), "stop" (SIGSTOP,
then SIGCONT from a child after ``seconds``) or "sleep" (a slow group).
``python -m jaxcomm.launch --replicas N`` passes ``JAXCOMM_FT_FAULTS`` (the
plan's path) on to the groups; :func:`from_env` reads it, and reads it again
whenever the file changes, so a harness can add faults while the job runs
(for a group and incarnation it sees alive). Each fault is
appended, as it fires, to the plan's path + ".fired" (one JSON line with the
wall time), so a harness can time what follows it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import NamedTuple

PHASES = ("inner", "exchange", "vote")
ACTIONS = ("kill", "stop", "sleep")


class Fault(NamedTuple):
    replica: int
    round: int
    phase: str
    action: str
    seconds: float = 0.0
    incarnation: int = 0


def load(path: str) -> list[Fault]:
    """The plan at ``path``; ValueError naming the entry that is wrong."""
    with open(path) as f:
        entries = json.load(f)
    faults = []
    for i, entry in enumerate(entries):
        try:
            fault = Fault(**entry)
        except TypeError as e:
            raise ValueError(f"fault plan {path}, entry {i}: {e}") from e
        if fault.phase not in PHASES or fault.action not in ACTIONS:
            raise ValueError(
                f"fault plan {path}, entry {i}: phase in {PHASES}, action in {ACTIONS}: {entry}"
            )
        faults.append(fault)
    return faults


class Injector:
    """Carries out the plan's faults for one replica group and incarnation.

    Args:
      faults: the plan.
      replica_id, incarnation: which group this is.
      log: a file to append each fired fault to (one JSON line), or None.
    """

    def __init__(self, faults, replica_id: int, incarnation: int, log: str | None = None):
        self.replica_id, self.incarnation, self.log = replica_id, incarnation, log
        self.path, self._version, self._fired = None, None, set()
        self._set(faults)

    @classmethod
    def watching(cls, path: str, replica_id: int, incarnation: int) -> Injector:
        """An injector that re-reads the plan at ``path`` whenever the file changes."""
        injector = cls([], replica_id, incarnation, path + ".fired")
        injector.path = path
        return injector

    def _set(self, faults):
        mine = [
            f for f in faults if f.replica == self.replica_id and f.incarnation == self.incarnation
        ]
        self.faults = [f for f in mine if f not in self._fired]

    def _reload(self):
        try:
            version = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if version != self._version:
            self._version = version
            self._set(load(self.path))

    def __call__(self, phase: str, round_: int) -> None:
        if self.path:
            self._reload()
        for fault in self.faults:
            if (fault.phase, fault.round) == (phase, round_):
                self.faults.remove(fault)
                self._fired.add(fault)
                print(f"fault: {fault.action} in round {round_}, phase {phase}", flush=True)
                if self.log:
                    with open(self.log, "a") as f:
                        f.write(json.dumps({**fault._asdict(), "time": time.time()}) + "\n")
                _act(fault)
                return


def _act(fault: Fault) -> None:
    pid = os.getpid()
    if fault.action == "kill":
        os.kill(pid, signal.SIGKILL)
    elif fault.action == "stop":
        # The child outlives our stop and wakes us; its own session keeps it out of our signals.
        subprocess.Popen(
            ["sh", "-c", f"sleep {fault.seconds}; kill -CONT {pid}"], start_new_session=True
        )
        os.kill(pid, signal.SIGSTOP)
    else:
        time.sleep(fault.seconds)


def from_env() -> Injector | None:
    """The injector ``JAXCOMM_FT_FAULTS`` asks for, or ``None`` without a plan."""
    path = os.environ.get("JAXCOMM_FT_FAULTS")
    if not path:
        return None
    replica = int(os.environ.get("JAXCOMM_FT_REPLICA_ID", "0"))
    return Injector.watching(path, replica, int(os.environ.get("JAXCOMM_FT_INCARNATION", "0")))
