"""The step simulator against hand-worked schedules."""

import math

import pytest

from jaxcomm.costmodel import Cluster, GradientTensor, Settings, Workload, simulate


def _net(p=2, *, bandwidth=1e9, latency=0.0):
    """One node of p ranks; with p = 2 a ring allreduce of n bytes takes n / bandwidth."""
    return Cluster(
        gpus_per_node=p,
        nodes=1,
        intra_bandwidth=bandwidth,
        intra_latency=latency,
        inter_bandwidth=bandwidth,
        inter_latency=latency,
    )


# Backward yields A then B, 1 s of backward each, after 1 s of forward.
# 1e8 float32 elements = 4e8 bytes = 0.4 s on the 2-rank, 1 GB/s ring.
TWO = Workload(
    (GradientTensor(100_000_000, 1.0), GradientTensor(100_000_000, 1.0)),
    forward_time=1.0,
    batch=10,
)


def _starts(result):
    return [(c.tensors, pytest.approx(c.start), pytest.approx(c.end)) for c in result.collectives]


def test_one_gpu_has_no_communication():
    r = simulate(TWO, _net(p=1), Settings(bucket_bytes=0.0))
    assert r.iteration_time == 3.0
    assert r.throughput == pytest.approx(10 / 3)
    assert r.speedup == pytest.approx(1.0)
    assert r.scaling_efficiency == pytest.approx(1.0)
    assert r.communication_time == 0.0


def test_no_overlap_everything_after_backward():
    r = simulate(TWO, _net(), Settings(bucket_bytes=0.0, overlap=False))
    assert _starts(r) == [((0,), 3.0, 3.4), ((1,), 3.4, 3.8)]
    assert r.iteration_time == pytest.approx(3.8)
    assert r.throughput == pytest.approx(2 * 10 / 3.8)
    assert r.speedup == pytest.approx(2 * 3.0 / 3.8)
    assert r.scaling_efficiency == pytest.approx(3.0 / 3.8)


def test_overlap_starts_each_bucket_when_its_gradient_exists():
    r = simulate(TWO, _net(), Settings(bucket_bytes=0.0, overlap=True))
    # A exists at 1 + 1 = 2 s and hides under B's backward; only B's 0.4 s shows.
    assert _starts(r) == [((0,), 2.0, 2.4), ((1,), 3.0, 3.4)]
    assert r.iteration_time == pytest.approx(3.4)


def test_one_bucket_waits_for_its_last_gradient():
    r = simulate(TWO, _net(), Settings(bucket_bytes=math.inf, overlap=True))
    assert _starts(r) == [((0, 1), 3.0, 3.8)]
    assert r.collectives[0].nbytes == 8e8


def test_network_runs_one_collective_at_a_time():
    # At 0.1 GB/s each tensor takes 4 s: B is ready at 3 s but waits until A ends at 6 s.
    r = simulate(TWO, _net(bandwidth=1e8), Settings(overlap=True))
    assert _starts(r) == [((0,), 2.0, 6.0), ((1,), 6.0, 10.0)]
    assert r.iteration_time == pytest.approx(10.0)
    assert r.communication_time == pytest.approx(8.0)


def test_bucket_threshold_groups_in_backward_order():
    # Three 4e8-byte tensors, theta = 8e8: (A, B) close together when B exists, C alone.
    three = Workload(
        tuple(GradientTensor(100_000_000, 1.0) for _ in range(3)), forward_time=1.0, batch=1
    )
    r = simulate(three, _net(), Settings(bucket_bytes=8e8, overlap=True))
    assert _starts(r) == [((0, 1), 3.0, 3.8), ((2,), 4.0, 4.4)]


def test_half_precision_wire_halves_the_bytes():
    r = simulate(TWO, _net(), Settings(wire_dtype="float16", overlap=True))
    assert [c.nbytes for c in r.collectives] == [2e8, 2e8]
    assert r.iteration_time == pytest.approx(3.2)
    r = simulate(TWO, _net(), Settings(wire_dtype="bfloat16", overlap=True))
    assert r.iteration_time == pytest.approx(3.2)


def test_double_buffering_hides_communication_under_the_next_step():
    r = simulate(TWO, _net(), Settings(overlap=False, double_buffering=True))
    assert r.iteration_time == pytest.approx(3.0)  # 0.8 s of traffic < 3 s of compute
    assert r.scaling_efficiency == pytest.approx(1.0)


def test_double_buffering_is_network_bound_when_traffic_exceeds_compute():
    r = simulate(TWO, _net(bandwidth=1e8), Settings(double_buffering=True))
    assert r.iteration_time == pytest.approx(8.0)  # 2 x 4 s of traffic per step


def test_latency_bound_fusion_saves_collectives():
    # 10 empty-ish tensors on 8 ranks with 1 ms per step: 14 ms per collective.
    ten = Workload(tuple(GradientTensor(1, 0.0) for _ in range(10)), forward_time=1.0, batch=1)
    net = _net(p=8, bandwidth=1e15, latency=1e-3)
    per_leaf = simulate(ten, net, Settings(bucket_bytes=0.0))
    fused = simulate(ten, net, Settings(bucket_bytes=math.inf))
    assert per_leaf.iteration_time == pytest.approx(1.0 + 10 * 14e-3)
    assert fused.iteration_time == pytest.approx(1.0 + 14e-3)


def test_chunk_sparse_sends_density_and_the_chunk_norms():
    # density 0.5: each tensor sends 2e8 bytes; 2e8 elements in chunks of 1e6 give
    # 200 float32 norms = 800 bytes, reduced after backward and after the buckets.
    s = Settings(overlap=True, density=0.5, chunk_elements=1_000_000)
    r = simulate(TWO, _net(), s)
    assert [c.nbytes for c in r.collectives] == [2e8, 2e8, 800]
    assert _starts(r)[:2] == [((0,), 2.0, 2.2), ((1,), 3.0, 3.2)]
    assert r.collectives[2].start == pytest.approx(3.2)
    assert r.iteration_time == pytest.approx(3.2 + 800 / 1e9)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(density=0.0),
        dict(density=1.5),
        dict(density=-0.1),
        dict(bucket_bytes=-1.0),
        dict(algorithm="butterfly"),
        dict(wire_dtype="int8"),
        dict(wire_dtype="not-a-dtype"),
        dict(chunk_elements=0),
    ],
)
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        Settings(**kwargs)


def test_bad_workload():
    with pytest.raises(ValueError):
        Workload((), forward_time=1.0, batch=0)
    with pytest.raises(ValueError):
        Workload((), forward_time=-1.0, batch=1)
    with pytest.raises(ValueError):
        GradientTensor(-1, 0.0)
    with pytest.raises(ValueError):
        GradientTensor(1, -1.0)
