"""A cluster of GPU nodes, and the allreduce times the alpha-beta model gives on it.

Topology. A node holds ``gpus_per_node`` GPUs. Inside a node they may sit on
several PCIe switches of ``gpus_per_switch`` GPUs each (e.g. "two PCIe switches
of 4"); traffic between switches crosses the CPU's root complex, whose
peer-to-peer bandwidth (``switch_bandwidth``) is often below a GPU's own x16
link. A ring laid out switch by switch (0-1-2-3 on one switch, 4-5-6-7 on the
other) crosses each switch boundary exactly once in each direction, so every
ring step still moves one flow per link and the ring runs at the slowest link:
``min(intra_bandwidth, switch_bandwidth)``. Each node has one NIC of
``inter_bandwidth``.

Algorithms:

* ``"ring"``: one flat ring over all ``p`` GPUs (NCCL 2's inter-node ring).
  Every step waits for its slowest link, so across nodes it pays the network's
  latency ``2(p-1)`` times and runs at ``min(intra, NIC)`` bandwidth (each node
  has one ring edge in and one out through its NIC).
* ``"hierarchical"``: ring reduce-scatter inside each node, ``L`` concurrent
  inter-node ring allreduces of ``n/L`` bytes (one per local rank), ring
  allgather inside each node. The ``L`` inter-node rings share the NIC, so each
  sees ``β₂ = L / inter_bandwidth``: the NIC still carries ``2(M-1)/M·n`` bytes
  (no bandwidth saved against the flat ring), but the network latency is paid
  ``2(M-1)`` times instead of ``2(p-1)``. Half of that NIC traffic also crosses
  the link between the switches; while ``switch_bandwidth`` is at least half
  the NIC's, the NIC stays the bottleneck, which holds for the clusters here.
* ``"tree"``: binomial tree over all ``p`` GPUs at the slowest link (comparison only).

An FP8 wire's allreduce (:meth:`Cluster.fp8_allreduce_time`) is an all-to-all
then a ring all-gather over all ``p`` GPUs. The all-to-all pays one latency
(its messages are in flight together). Its bytes: each GPU sends
``(p-1)/p·n`` through its own link, and across nodes each NIC carries the
``L`` GPUs' rows for the other nodes, ``L(M-1)/M·n``: ``L`` times the ring's
``(p-1)/p·n`` per direction, so across nodes of several GPUs the all-to-all
is bandwidth-bound on the NIC where the ring is not. The all-gather is a
flat ring's second half.

Examples:
  >>> c = Cluster(gpus_per_node=8, nodes=2, intra_bandwidth=10e9, intra_latency=0.0,
  ...             inter_bandwidth=5e9, inter_latency=0.0)
  >>> c.p
  16
  >>> round(c.allreduce_time(16e6, algorithm="ring") * 1e3, 3)  # 2*15/16*16e6 B at 5 GB/s
  6.0
"""

from __future__ import annotations

import dataclasses

from jaxcomm._validate import check_nonnegative, check_ranks
from jaxcomm.costmodel.alphabeta import (
    allgather_time,
    alltoall_time,
    hierarchical_allreduce_time,
    ring_allreduce_time,
    tree_allreduce_time,
)

ALGORITHMS = ("ring", "hierarchical", "tree")

# Link figures of the clusters below. Bandwidths in bytes/s, one direction;
# latencies in seconds per ring step. The network rates are those of the
# scenarios modelled (GradientFlow's InfiniBand clusters, a 25 Gbps Ethernet
# cluster); the others are assumptions of typical hardware, stated here.
IB_FDR_BANDWIDTH = 56e9 / 8  # 56 Gbps InfiniBand FDR, 7.0 GB/s
ETHERNET_25G_BANDWIDTH = 25e9 / 8  # 25 Gbps Ethernet, 3.125 GB/s
PCIE3_X16_BANDWIDTH = 12e9  # assumed: PCIe 3.0 x16 is 15.75 GB/s raw, ~12 GB/s for P2P copies
CPU_P2P_BANDWIDTH = 9e9  # assumed: GPU P2P through the CPU root complex, between PCIe switches
NVLINK_V100_BANDWIDTH = 100e9  # assumed: 8 x V100 NVLink hybrid cube mesh, ring busbw
PCIE_LATENCY = 5e-6  # assumed: one NCCL ring step inside a node
IB_LATENCY = 10e-6  # assumed: one NCCL ring step over InfiniBand (verbs + proxy thread)
ETHERNET_LATENCY = 30e-6  # assumed: one ring step over TCP sockets on 25 GbE
NVLINK_LATENCY = 5e-6  # assumed: one NCCL ring step over NVLink


@dataclasses.dataclass(frozen=True)
class Cluster:
    """GPU nodes joined by a network.

    Attributes:
      gpus_per_node: GPUs (ranks) in one node, L.
      nodes: number of nodes, M.
      intra_bandwidth: bytes/s of one GPU's link inside a node.
      intra_latency: seconds per ring step inside a node.
      inter_bandwidth: bytes/s of one node's NIC.
      inter_latency: seconds per ring step between nodes.
      gpus_per_switch: GPUs per PCIe switch, or None when all GPUs of a node
        share one fabric. Must divide ``gpus_per_node``.
      switch_bandwidth: bytes/s between two switches of one node (needed when
        a node has several switches).
    """

    gpus_per_node: int
    nodes: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    gpus_per_switch: int | None = None
    switch_bandwidth: float | None = None

    def __post_init__(self):
        check_ranks("gpus_per_node", self.gpus_per_node)
        check_ranks("nodes", self.nodes)
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if check_nonnegative(name, getattr(self, name)) == 0:
                raise ValueError(f"{name} must be > 0 bytes/s")
        check_nonnegative("intra_latency", self.intra_latency)
        check_nonnegative("inter_latency", self.inter_latency)
        if self.gpus_per_switch is not None:
            check_ranks("gpus_per_switch", self.gpus_per_switch)
            if self.gpus_per_node % self.gpus_per_switch:
                raise ValueError(
                    f"gpus_per_switch={self.gpus_per_switch} must divide "
                    f"gpus_per_node={self.gpus_per_node}"
                )
            if self.switches_per_node > 1 and (
                self.switch_bandwidth is None
                or check_nonnegative("switch_bandwidth", self.switch_bandwidth) == 0
            ):
                raise ValueError("a node with several switches needs switch_bandwidth > 0")

    @property
    def p(self) -> int:
        """All GPUs."""
        return self.gpus_per_node * self.nodes

    @property
    def switches_per_node(self) -> int:
        return 1 if self.gpus_per_switch is None else self.gpus_per_node // self.gpus_per_switch

    @property
    def intra_ring_bandwidth(self) -> float:
        """Bytes/s of one ring flow inside a node: the slowest link it crosses."""
        if self.switches_per_node > 1:
            return min(self.intra_bandwidth, self.switch_bandwidth)
        return self.intra_bandwidth

    def with_nodes(self, nodes: int) -> Cluster:
        """The same kind of node, ``nodes`` of them."""
        return dataclasses.replace(self, nodes=nodes)

    def _flat_link(self) -> tuple[float, float]:
        """(α, β) of one step of a ring over all GPUs: its slowest link."""
        alpha1, beta1 = self.intra_latency, 1 / self.intra_ring_bandwidth
        alpha2, beta2 = self.inter_latency, 1 / self.inter_bandwidth
        if self.nodes == 1:
            return alpha1, beta1
        if self.gpus_per_node == 1:
            return alpha2, beta2
        return max(alpha1, alpha2), max(beta1, beta2)

    def alltoall_time(self, nbytes: float) -> float:
        """Seconds for an all-to-all of a buffer of ``nbytes`` (``p`` rows) per GPU.

        One latency (the slowest link's); bytes: ``(p-1)/p·nbytes`` through
        each GPU's link, and ``L(M-1)/M·nbytes`` through each NIC when there
        are several nodes, whichever takes longer.

        Examples:
          >>> c = Cluster(gpus_per_node=4, nodes=2, intra_bandwidth=1e9, intra_latency=0.0,
          ...             inter_bandwidth=1e9, inter_latency=1e-3)
          >>> round(c.alltoall_time(8e6), 9)  # NIC: 4 GPUs x 1/2 of 8e6 B at 1 GB/s, + 1 ms
          0.017
        """
        alpha, beta = self._flat_link()
        if self.nodes == 1 or self.gpus_per_node == 1:
            return alltoall_time(nbytes, p=self.p, alpha=alpha, beta=beta)
        n = check_nonnegative("nbytes", nbytes)
        local, nodes = self.gpus_per_node, self.nodes
        own_link = (self.p - 1) / self.p * n / self.intra_ring_bandwidth
        nic = local * (nodes - 1) / nodes * n / self.inter_bandwidth
        return alpha + max(own_link, nic)

    def allgather_time(self, nbytes: float) -> float:
        """Seconds for a ring all-gather of ``nbytes`` (``nbytes/p`` from each GPU) over
        all GPUs, at the flat ring's slowest link.

        Examples:
          >>> cpu_host(devices=4, alpha=1.0, beta=1e-9).allgather_time(4e6)  # 3 steps of 1e6 B
          3.003
        """
        alpha, beta = self._flat_link()
        return allgather_time(nbytes, p=self.p, alpha=alpha, beta=beta)

    def allreduce_time(self, nbytes: float, *, algorithm: str = "ring") -> float:
        """Seconds for an allreduce of ``nbytes`` per GPU over all GPUs.

        Examples:
          >>> c = Cluster(gpus_per_node=4, nodes=1, intra_bandwidth=1e9, intra_latency=1e-6,
          ...             inter_bandwidth=1e9, inter_latency=1e-5)
          >>> c.allreduce_time(0.0)  # one node: 6 intra-node steps
          6e-06
        """
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r} must be one of {ALGORITHMS}")
        alpha1, beta1 = self.intra_latency, 1 / self.intra_ring_bandwidth
        alpha2, beta2 = self.inter_latency, 1 / self.inter_bandwidth
        alpha, beta = self._flat_link()
        if algorithm == "tree":
            return tree_allreduce_time(nbytes, p=self.p, alpha=alpha, beta=beta)
        if algorithm == "ring" or self.nodes == 1 or self.gpus_per_node == 1:
            return ring_allreduce_time(nbytes, p=self.p, alpha=alpha, beta=beta)
        return hierarchical_allreduce_time(
            nbytes,
            local=self.gpus_per_node,
            nodes=self.nodes,
            alpha_intra=alpha1,
            beta_intra=beta1,
            alpha_inter=alpha2,
            beta_inter=self.gpus_per_node * beta2,  # the L inter-node rings share one NIC
        )


def pcie_infiniband(*, nodes: int) -> Cluster:
    """GradientFlow's clusters: nodes of 8 GPUs on two PCIe switches of 4, 56 Gbps InfiniBand.

    ``pcie_infiniband(nodes=16)`` is ``pascal128``, ``nodes=64`` is ``volta512``.

    Examples:
      >>> pcie_infiniband(nodes=16).p
      128
    """
    return Cluster(
        gpus_per_node=8,
        nodes=nodes,
        intra_bandwidth=PCIE3_X16_BANDWIDTH,
        intra_latency=PCIE_LATENCY,
        inter_bandwidth=IB_FDR_BANDWIDTH,
        inter_latency=IB_LATENCY,
        gpus_per_switch=4,
        switch_bandwidth=CPU_P2P_BANDWIDTH,
    )


def nvlink_ethernet(*, nodes: int) -> Cluster:
    """The Ethernet scenario: nodes of 8 V100 (NVLink) on 25 Gbps Ethernet.

    Examples:
      >>> round(nvlink_ethernet(nodes=4).inter_bandwidth / 1e9, 3)
      3.125
    """
    return Cluster(
        gpus_per_node=8,
        nodes=nodes,
        intra_bandwidth=NVLINK_V100_BANDWIDTH,
        intra_latency=NVLINK_LATENCY,
        inter_bandwidth=ETHERNET_25G_BANDWIDTH,
        inter_latency=ETHERNET_LATENCY,
    )


def cpu_host(*, devices: int, alpha: float, beta: float) -> Cluster:
    """One node of ``devices`` ranks joined by a link of ``alpha`` s, ``beta`` s/byte.

    This is what :func:`jaxcomm.costmodel.fit_alpha_beta` measures on a live mesh.

    Examples:
      >>> cpu_host(devices=8, alpha=1e-6, beta=1e-9).allreduce_time(0)
      1.4e-05
    """
    check_nonnegative("beta", beta)
    if beta == 0:
        raise ValueError("beta must be > 0 s/byte")
    return Cluster(
        gpus_per_node=devices,
        nodes=1,
        intra_bandwidth=1 / beta,
        intra_latency=alpha,
        inter_bandwidth=1 / beta,
        inter_latency=alpha,
    )
