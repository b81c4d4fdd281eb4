"""Fault-tolerant replica groups: training that survives lost and returning hosts.

Replica groups are independent JAX runtimes that meet only in a host exchange
over the slow network. A :class:`Lighthouse` forms a quorum per round; each
group's :class:`Replica` runs the round (quorum, healing, exchange with a
deadline, commit vote); in a group of several processes it runs on rank 0 and
:class:`Group` broadcasts the outcome to the other ranks. :class:`DiLoCo` and
:class:`DataParallel` wrap an optax optimizer into a training step that
commits or rolls back. Start a job with
``python -m jaxcomm.launch --replicas N train.py``; docs/fault_tolerance.md.
"""

from jaxcomm.ft._trainer import ReplicaState, RoundLog
from jaxcomm.ft.data_parallel import DataParallel
from jaxcomm.ft.diloco import DiLoCo
from jaxcomm.ft.exchange import ExchangeAborted
from jaxcomm.ft.group import Group
from jaxcomm.ft.replica import JobFinished, Replica, Round
from jaxcomm.ft.snapshot import Snapshot

__all__ = [
    "DataParallel",
    "DiLoCo",
    "ExchangeAborted",
    "Group",
    "JobFinished",
    "Lighthouse",
    "Replica",
    "ReplicaState",
    "Round",
    "RoundLog",
    "Snapshot",
]


def __getattr__(name):
    # Imported on use, so that ``python -m jaxcomm.ft.lighthouse`` finds it not yet imported.
    if name == "Lighthouse":
        from jaxcomm.ft.lighthouse import Lighthouse

        return Lighthouse
    raise AttributeError(f"module 'jaxcomm.ft' has no attribute {name!r}")
