"""The alpha-beta model and the cluster against hand-computed allreduce times."""

import math

import pytest

from jaxcomm.costmodel import (
    Cluster,
    allgather_time,
    alltoall_time,
    hierarchical_allreduce_time,
    pcie_infiniband,
    ring_allreduce_time,
    tree_allreduce_time,
)

US = 1e-6


def test_ring_one_rank_sends_nothing():
    assert ring_allreduce_time(1e9, p=1, alpha=1.0, beta=1.0) == 0.0


def test_ring_two_ranks():
    # One reduce-scatter step and one allgather step, each moving n/2.
    t = ring_allreduce_time(1e6, p=2, alpha=10 * US, beta=1e-9)
    assert t == pytest.approx(2 * 10 * US + 1e6 * 1e-9)


def test_ring_latency_bound_limit():
    # Empty message: only the 2(p-1) step latencies.
    assert ring_allreduce_time(0, p=8, alpha=3 * US, beta=1e-9) == pytest.approx(14 * 3 * US)


def test_ring_bandwidth_bound_limit_tends_to_2n_beta():
    n, beta = 1e8, 1e-10
    assert ring_allreduce_time(n, p=4, alpha=0, beta=beta) == pytest.approx(1.5 * n * beta)
    large_p = ring_allreduce_time(n, p=100_000, alpha=0, beta=beta)
    assert large_p == pytest.approx(2 * n * beta, rel=1e-4)
    assert large_p < 2 * n * beta


def test_hierarchical_hand_case():
    # L=4, M=2: 2*3*1 + 2*3/4*100*0.01 + 2*1*10 + 2*1/2*25*0.1 = 6 + 1.5 + 20 + 2.5
    t = hierarchical_allreduce_time(
        100, local=4, nodes=2, alpha_intra=1, beta_intra=0.01, alpha_inter=10, beta_inter=0.1
    )
    assert t == pytest.approx(30.0)


def test_hierarchical_degenerates_to_ring():
    kw = dict(alpha_intra=1.0, beta_intra=0.5, alpha_inter=7.0, beta_inter=3.0)
    one_node = hierarchical_allreduce_time(64, local=8, nodes=1, **kw)
    assert one_node == pytest.approx(ring_allreduce_time(64, p=8, alpha=1.0, beta=0.5))
    one_per_node = hierarchical_allreduce_time(64, local=1, nodes=8, **kw)
    assert one_per_node == pytest.approx(ring_allreduce_time(64, p=8, alpha=7.0, beta=3.0))


@pytest.mark.parametrize(("p", "levels"), [(1, 0), (2, 1), (5, 3), (8, 3), (512, 9)])
def test_tree_levels(p, levels):
    assert tree_allreduce_time(10, p=p, alpha=1.0, beta=0.1) == pytest.approx(2 * levels * 2.0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(p=0), ValueError),
        (dict(p=-2), ValueError),
        (dict(p=2.0), TypeError),
        (dict(p=True), TypeError),
        (dict(alpha=-1.0), ValueError),
        (dict(beta=math.nan), ValueError),
        (dict(beta=-1e-9), ValueError),
        (dict(nbytes=-1), ValueError),
    ],
)
def test_bad_input(kwargs, error):
    args = dict(nbytes=8, p=2, alpha=0.0, beta=0.0) | kwargs
    nbytes = args.pop("nbytes")
    for fn in (ring_allreduce_time, tree_allreduce_time):
        with pytest.raises(error):
            fn(nbytes, **args)


def _cluster(**kw):
    base = dict(
        gpus_per_node=8,
        nodes=1,
        intra_bandwidth=12e9,
        intra_latency=5 * US,
        inter_bandwidth=7e9,
        inter_latency=10 * US,
    )
    return Cluster(**(base | kw))


def test_one_node_uses_the_intra_link():
    # 14 steps of 5 us + 2*7/8 * 12e6 bytes at 12 GB/s.
    assert _cluster().allreduce_time(12e6) == pytest.approx(70 * US + 1.75e-3)


def test_two_pcie_switches_cap_the_intra_ring_at_the_cross_switch_link():
    # The ring crosses the CPU root complex between the two switches: 9 GB/s, not 12.
    c = _cluster(gpus_per_switch=4, switch_bandwidth=9e9)
    assert c.intra_ring_bandwidth == 9e9
    assert c.allreduce_time(9e6) == pytest.approx(70 * US + 1.75e-3)
    assert pcie_infiniband(nodes=1).allreduce_time(9e6) == pytest.approx(70 * US + 1.75e-3)
    # A faster root complex leaves the GPU's own link as the bottleneck.
    assert _cluster(gpus_per_switch=4, switch_bandwidth=20e9).intra_ring_bandwidth == 12e9


def test_flat_ring_across_nodes_runs_at_the_slowest_link_and_latency():
    # 16 ranks: 30 steps of 10 us + 2*15/16 * 7e6 bytes at 7 GB/s.
    c = _cluster(nodes=2)
    assert c.allreduce_time(7e6, algorithm="ring") == pytest.approx(300 * US + 1.875e-3)


def test_hierarchical_across_nodes_shares_the_nic():
    # Intra: 14*5us + 2*7/8*n/9e9. Inter: 8 rings of n/8 share the 7 GB/s NIC:
    # 2*1*10us + 2*1/2*(n/8)*(8/7e9) = 20us + n/7e9. With n = 63e6:
    n = 63e6
    expected = 70 * US + 1.75 * n / 9e9 + 20 * US + n / 7e9
    assert pcie_infiniband(nodes=2).allreduce_time(n, algorithm="hierarchical") == pytest.approx(
        expected
    )


def test_hierarchical_pays_fewer_network_latencies():
    c = pcie_infiniband(nodes=64)
    assert c.allreduce_time(0, algorithm="ring") == pytest.approx(2 * 511 * 10 * US)
    assert c.allreduce_time(0, algorithm="hierarchical") == pytest.approx(
        14 * 5 * US + 126 * 10 * US
    )


def test_tree_on_cluster_uses_slowest_link():
    c = _cluster(nodes=2)  # 16 ranks: 4 levels, twice
    assert c.allreduce_time(7e3, algorithm="tree") == pytest.approx(8 * (10 * US + 1e-6))


def test_single_gpu_cluster_sends_nothing():
    c = _cluster(gpus_per_node=1)
    for algorithm in ("ring", "hierarchical", "tree"):
        assert c.allreduce_time(1e9, algorithm=algorithm) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gpus_per_node=0),
        dict(nodes=0),
        dict(intra_bandwidth=0.0),
        dict(inter_bandwidth=-1e9),
        dict(inter_latency=-1.0),
        dict(gpus_per_switch=3),
        dict(gpus_per_switch=4),  # two switches and no switch_bandwidth
        dict(gpus_per_switch=4, switch_bandwidth=-1.0),
    ],
)
def test_bad_cluster(kwargs):
    with pytest.raises(ValueError):
        _cluster(**kwargs)


def test_bad_algorithm():
    with pytest.raises(ValueError, match="algorithm"):
        _cluster().allreduce_time(1, algorithm="butterfly")


# --- The FP8 wire's collectives: all-to-all and ring all-gather. ------------------


def test_alltoall_pays_one_latency_and_the_ring_half_bytes():
    # 4 ranks, 4000-byte buffer: 3 rows of 1000 leave each rank, all in flight at once.
    assert alltoall_time(4000, p=4, alpha=5.0, beta=1e-3) == pytest.approx(5.0 + 3000 * 1e-3)
    assert alltoall_time(4000, p=1, alpha=5.0, beta=1e-3) == 0.0


def test_allgather_is_a_ring_half():
    # 3 steps of 1000 bytes each.
    assert allgather_time(4000, p=4, alpha=5.0, beta=1e-3) == pytest.approx(3 * (5.0 + 1.0))
    assert allgather_time(4000, p=1, alpha=5.0, beta=1e-3) == 0.0


def test_alltoall_plus_allgather_against_the_ring():
    # Same bytes as a ring allreduce, p latencies instead of 2(p-1).
    n, p, a, b = 1e6, 8, 1e-3, 1e-9
    both = alltoall_time(n, p=p, alpha=a, beta=b) + allgather_time(n, p=p, alpha=a, beta=b)
    assert both == pytest.approx(ring_allreduce_time(n, p=p, alpha=a, beta=b) - 6 * a)


def test_cluster_alltoall_across_nodes_is_nic_bound():
    # 4 GPUs a node, 2 nodes, 1 GB/s everywhere: each NIC carries the 4 GPUs'
    # rows for the other node, 4 x 4 x 1e6 bytes = 16e6 (a GPU's own link 7e6).
    c = Cluster(
        gpus_per_node=4,
        nodes=2,
        intra_bandwidth=1e9,
        intra_latency=1e-6,
        inter_bandwidth=1e9,
        inter_latency=1e-3,
    )
    assert c.alltoall_time(8e6) == pytest.approx(1e-3 + 16e-3)
    # A fast NIC leaves each GPU's own 7 of 8 rows: 7e6 bytes at 1 GB/s.
    fast_nic = Cluster(
        gpus_per_node=4,
        nodes=2,
        intra_bandwidth=1e9,
        intra_latency=1e-6,
        inter_bandwidth=1e12,
        inter_latency=1e-3,
    )
    assert fast_nic.alltoall_time(8e6) == pytest.approx(1e-3 + 7e-3)
    # The all-gather is the flat ring's half: 7 steps of 1e6 bytes, at the NIC's latency.
    assert c.allgather_time(8e6) == pytest.approx(7 * (1e-3 + 1e-3))


def test_cluster_alltoall_on_one_node():
    c = Cluster(
        gpus_per_node=2,
        nodes=1,
        intra_bandwidth=1e9,
        intra_latency=2e-6,
        inter_bandwidth=1.0,
        inter_latency=1.0,
    )
    assert c.alltoall_time(2e6) == pytest.approx(2e-6 + 1e-3)
