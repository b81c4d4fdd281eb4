"""jaxcomm.costmodel: an alpha-beta model of the cluster, a step simulator and a planner.

* :mod:`~jaxcomm.costmodel.alphabeta`: ring, hierarchical and tree allreduce times,
  and the all-to-all and all-gather of an FP8 wire's allreduce.
* :class:`Cluster`: GPUs per node, nodes, links; ``allreduce_time(nbytes, algorithm=...)``.
* :func:`simulate`: iteration time, throughput, speedup and scaling efficiency of
  one data-parallel step under jaxcomm's settings (fusion, wire dtype including
  FP8, overlap, double buffering, chunk-sparse density, PowerSGD).
* :mod:`~jaxcomm.costmodel.profiles`: ResNet-50 and AlexNet-BN profiles from Flax models
  (imported on first use: flax is an optional dependency).
* :func:`fit_alpha_beta`, :func:`measure_allreduce`, :func:`fit_cluster`: fit α and β
  to allreduce times measured on the live mesh.
* :func:`time_call`, :func:`time_rounds`: the timing loop behind those measurements
  and the benchmarks (one call in flight, interleaved rounds).
* :func:`plan`: recommends bucket size, algorithm and wire dtype with the predicted
  gain of each.
* :func:`recommend`: ranks whole configurations (dense, compressed, sparse,
  DiLoCo, ...) by predicted time to a quality target on a link, from their
  measured steps to it.
"""

from jaxcomm.costmodel.alphabeta import (
    allgather_time,
    alltoall_time,
    hierarchical_allreduce_time,
    ring_allreduce_time,
    tree_allreduce_time,
)
from jaxcomm.costmodel.cluster import Cluster, cpu_host, nvlink_ethernet, pcie_infiniband
from jaxcomm.costmodel.fit import LinkFit, fit_alpha_beta, fit_cluster, measure_allreduce
from jaxcomm.costmodel.plan import Plan, plan
from jaxcomm.costmodel.recommend import Candidate, Choice, Recommendation, recommend
from jaxcomm.costmodel.simulator import GradientTensor, Result, Settings, Workload, simulate
from jaxcomm.costmodel.timing import time_call, time_rounds

_PROFILE_NAMES = ("ModelProfile", "alexnet_bn", "resnet50")


def __getattr__(name):
    # Profiles need flax, which jaxcomm itself does not depend on.
    if name in _PROFILE_NAMES:
        from jaxcomm.costmodel import profiles

        return getattr(profiles, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "allgather_time",
    "alltoall_time",
    "Candidate",
    "Choice",
    "Cluster",
    "GradientTensor",
    "LinkFit",
    "ModelProfile",
    "Plan",
    "Recommendation",
    "Result",
    "Settings",
    "Workload",
    "alexnet_bn",
    "cpu_host",
    "fit_alpha_beta",
    "fit_cluster",
    "hierarchical_allreduce_time",
    "measure_allreduce",
    "nvlink_ethernet",
    "pcie_infiniband",
    "plan",
    "recommend",
    "resnet50",
    "ring_allreduce_time",
    "simulate",
    "time_call",
    "time_rounds",
    "tree_allreduce_time",
]
