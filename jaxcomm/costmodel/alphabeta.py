"""Alpha-beta (latency-bandwidth) cost of allreduce algorithms.

``alpha`` is the latency of one step (seconds), ``beta`` the time per byte on
one link (seconds per byte, the inverse of bandwidth), ``nbytes`` the message
each rank contributes and receives, ``p`` the number of ranks.

* ring (reduce-scatter then allgather, NCCL's ring): ``2(p-1)`` steps, each
  sending ``nbytes/p``: ``2(p-1)α + 2(p-1)/p·nβ``.
* hierarchical, ``local`` ranks per node and ``nodes`` nodes: a ring
  reduce-scatter inside the node, a ring allreduce of the ``1/local`` shard
  between nodes, a ring allgather inside the node:
  ``2(L-1)α₁ + 2(L-1)/L·nβ₁ + 2(M-1)α₂ + 2(M-1)/M·(n/L)β₂``. ``β₂`` is per
  inter-node ring; when the ``L`` rings share one NIC, pass ``β₂ = L/B_nic``
  (see :class:`jaxcomm.costmodel.Cluster`).
* tree (for comparison): a binomial-tree reduce then broadcast of the whole
  message, not pipelined: ``2⌈log2 p⌉(α + nβ)``. Latency grows with log p
  instead of p, bandwidth cost with log p instead of staying below 2nβ.
* all-to-all (the first half of an FP8 wire's allreduce), ``nbytes`` the
  whole buffer of ``p`` rows: every rank posts its ``p-1`` sends and receives
  at once and then waits for them all (gloo's all-to-all, as XLA's CPU
  collectives run it; NCCL groups its point-to-point calls the same way), so
  the latencies overlap and one step is paid, while the ``(p-1)/p·n`` bytes
  still leave through the rank's one link: ``α + (p-1)/p·nβ``.
* ring all-gather (the second half): ``p-1`` steps of ``n/p``:
  ``(p-1)α + (p-1)/p·nβ``. With the all-to-all, ``pα + 2(p-1)/p·nβ``:
  the ring's bytes, ``p-2`` fewer latencies.

Examples:
  >>> ring_allreduce_time(1000, p=4, alpha=1e-6, beta=1e-9)  # 6 us + 1.5 us
  7.5e-06
  >>> round(tree_allreduce_time(1000, p=4, alpha=1e-6, beta=1e-9) * 1e6, 9)  # 4 steps of 2 us
  8.0
  >>> alltoall_time(1000, p=4, alpha=1e-6, beta=1e-9)  # one latency + 750 bytes
  1.75e-06
"""

from __future__ import annotations

from jaxcomm._validate import check_nonnegative, check_ranks


def ring_allreduce_time(nbytes: float, *, p: int, alpha: float, beta: float) -> float:
    """Ring allreduce: ``2(p-1)α + 2(p-1)/p·nbytes·β``; 0 for ``p = 1``.

    Examples:
      >>> ring_allreduce_time(8e6, p=2, alpha=0.0, beta=1e-9)  # p=2: 1 step each way, n/2 each
      0.008
    """
    n = check_nonnegative("nbytes", nbytes)
    p = check_ranks("p", p)
    alpha = check_nonnegative("alpha", alpha)
    beta = check_nonnegative("beta", beta)
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta


def hierarchical_allreduce_time(
    nbytes: float,
    *,
    local: int,
    nodes: int,
    alpha_intra: float,
    beta_intra: float,
    alpha_inter: float,
    beta_inter: float,
) -> float:
    """Hierarchical allreduce of ``local`` ranks per node on ``nodes`` nodes.

    ``2(L-1)α₁ + 2(L-1)/L·nβ₁ + 2(M-1)α₂ + 2(M-1)/M·(n/L)β₂``, with ``β₂``
    the time per byte of one of the ``L`` concurrent inter-node rings.

    Examples:
      >>> hierarchical_allreduce_time(800, local=2, nodes=2, alpha_intra=1.0,
      ...     beta_intra=0.0, alpha_inter=10.0, beta_inter=0.0)  # 2 + 20
      22.0
    """
    n = check_nonnegative("nbytes", nbytes)
    local = check_ranks("local", local)
    nodes = check_ranks("nodes", nodes)
    intra = ring_allreduce_time(n, p=local, alpha=alpha_intra, beta=beta_intra)
    inter = ring_allreduce_time(n / local, p=nodes, alpha=alpha_inter, beta=beta_inter)
    return intra + inter


def tree_allreduce_time(nbytes: float, *, p: int, alpha: float, beta: float) -> float:
    """Binomial-tree reduce + broadcast: ``2⌈log2 p⌉(α + nbytes·β)``; 0 for ``p = 1``.

    Examples:
      >>> tree_allreduce_time(0, p=5, alpha=1.0, beta=0.0)  # ceil(log2 5) = 3 levels, twice
      6.0
    """
    n = check_nonnegative("nbytes", nbytes)
    p = check_ranks("p", p)
    alpha = check_nonnegative("alpha", alpha)
    beta = check_nonnegative("beta", beta)
    levels = (p - 1).bit_length()  # ceil(log2 p) for p >= 1
    return 2 * levels * (alpha + n * beta)


def alltoall_time(nbytes: float, *, p: int, alpha: float, beta: float) -> float:
    """All-to-all of a buffer of ``p`` rows: ``α + (p-1)/p·nbytes·β``; 0 for ``p = 1``.

    Every send and receive is posted before any is waited for, so the ``p-1``
    latencies overlap; the bytes share the rank's link.

    Examples:
      >>> alltoall_time(8e6, p=8, alpha=1.0, beta=1e-9)  # 1 latency, 7e6 bytes
      1.007
    """
    n = check_nonnegative("nbytes", nbytes)
    p = check_ranks("p", p)
    alpha = check_nonnegative("alpha", alpha)
    beta = check_nonnegative("beta", beta)
    if p == 1:
        return 0.0
    return alpha + (p - 1) / p * n * beta


def allgather_time(nbytes: float, *, p: int, alpha: float, beta: float) -> float:
    """Ring all-gather of a result of ``nbytes`` (``nbytes/p`` from each rank):
    ``(p-1)α + (p-1)/p·nbytes·β``.

    Examples:
      >>> allgather_time(8e6, p=8, alpha=1.0, beta=1e-9)  # 7 steps of 1e6 bytes
      7.007
    """
    n = check_nonnegative("nbytes", nbytes)
    p = check_ranks("p", p)
    alpha = check_nonnegative("alpha", alpha)
    beta = check_nonnegative("beta", beta)
    return (p - 1) * alpha + (p - 1) / p * n * beta
