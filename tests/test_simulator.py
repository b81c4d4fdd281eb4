"""The step simulator against hand-worked schedules."""

import math
import re
from pathlib import Path

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
        dict(wire_dtype="int16"),
        dict(wire_dtype="int8", algorithm="tree"),
        dict(wire_dtype="int4", density=0.5),
        dict(wire_dtype="not-a-dtype"),
        dict(chunk_elements=0),
        dict(wire_dtype="float8_e4m3fn", algorithm="hierarchical"),
        dict(wire_dtype="float8_e5m2", density=0.5),
        dict(powersgd_rank=0),
        dict(powersgd_rank=2, density=0.5),
        dict(powersgd_rank=2, double_buffering=True),
        dict(powersgd_rank=2, wire_dtype="float8_e4m3fn"),
        dict(min_compression_rate=0.0),
        dict(sync_every=0),
        dict(sync_every=4, fragments=0),
        dict(sync_every=4, fragments=5),
        dict(fragments=2),
        dict(sync_every=4, density=0.5),
        dict(sync_every=4, double_buffering=True),
        dict(sync_every=4, powersgd_rank=2),
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
    with pytest.raises(ValueError, match="shape"):
        GradientTensor(6, 0.0, shape=(2, 2))
    with pytest.raises(TypeError, match="shape"):
        GradientTensor(4, 0.0, shape=[2, 2])
    with pytest.raises(TypeError, match="min_compression_rate"):
        Settings(min_compression_rate="2")


# --- FP8 wires ----------------------------------------------------------------


def test_fp8_wire_bytes_exponents_padding_and_latency():
    # 4 ranks, 1 ms a step, 1 MB/s. One bucket of 1000 + 1001 elements (2 parts):
    # 2001 bytes padded to 4 rows of 501. All-to-all: each rank sends 3 rows of
    # 501 + 2 x 2 exponent bytes = 1515 bytes, one latency; all-gather: 3 rows
    # of 501 + 2 = 1509 bytes, 3 latencies.
    w = Workload((GradientTensor(1000, 1.0), GradientTensor(1001, 0.0)), forward_time=0.0, batch=1)
    net = _net(p=4, bandwidth=1e6, latency=1e-3)
    r = simulate(w, net, Settings(wire_dtype="float8_e4m3fn", bucket_bytes=math.inf))
    (c,) = r.collectives
    assert c.nbytes == 4 * (501 + 2 + 1)  # jaxcomm's payload: bytes_sent is 2(p-1)/p of it
    assert c.end - c.start == pytest.approx(4e-3 + (1515 + 1509) / 1e6)
    assert r.iteration_time == pytest.approx(1.0 + 4e-3 + 3024e-6)


def test_fp8_wire_unfused_has_one_exponent_per_collective_and_fewer_latencies_than_a_ring():
    # 8 ranks, 800 elements a leaf (rows of 100), bucket_bytes=0: two collectives.
    # Per collective: 7 x (100 + 2) + 7 x (100 + 2) bytes and 8 latencies, where the
    # float16 ring moves 2 x 7/8 x 1600 = 2800 bytes in 14 latencies.
    w = Workload((GradientTensor(800, 0.0), GradientTensor(800, 0.0)), forward_time=0.0, batch=1)
    net = _net(p=8, bandwidth=1e6, latency=1e-3)
    fp8 = simulate(w, net, Settings(wire_dtype="float8_e5m2"))
    assert [c.nbytes for c in fp8.collectives] == [8 * 102, 8 * 102]
    assert fp8.iteration_time == pytest.approx(2 * (8e-3 + 1428e-6))
    fp16 = simulate(w, net, Settings(wire_dtype="float16"))
    assert fp16.iteration_time == pytest.approx(2 * (14e-3 + 2800e-6))


def test_fp8_wire_on_one_rank_sends_nothing():
    w = Workload((GradientTensor(1000, 1.0),), forward_time=0.0, batch=1)
    r = simulate(w, _net(p=1, latency=1.0), Settings(wire_dtype="float8_e4m3fn"))
    assert r.iteration_time == 1.0 and r.communication_time == 0.0


# --- PowerSGD -------------------------------------------------------------------

# Backward order. At rank 4 and rate 2: (100, 50) is compressed ((150) x 8 <= 5000),
# P 400 and Q 200 elements; (50,), (10, 3, 4) ((10 + 12) x 8 > 120) and (8, 8)
# ((16) x 8 > 64) are sent densely: 50 + 120 + 64 = 234 elements.
PSGD = Workload(
    (
        GradientTensor(5000, 1.0, shape=(100, 50)),
        GradientTensor(50, 1.0, shape=(50,)),
        GradientTensor(120, 0.0, shape=(10, 3, 4)),
        GradientTensor(64, 1.0, shape=(8, 8)),
    ),
    forward_time=1.0,
    batch=1,
)


def test_powersgd_sends_dense_leaves_then_p_then_q_after_backward():
    # 2 ranks at 1 kB/s: n bytes take n / 1000 s.
    r = simulate(PSGD, _net(bandwidth=1e3), Settings(powersgd_rank=4, powersgd_mask=None))
    kinds = [(c.kind, c.tensors, c.nbytes) for c in r.collectives]
    assert kinds == [("gradients", (1, 2, 3), 936), ("P", (0,), 1600), ("Q", (0,), 800)]
    assert _starts(r) == [((1, 2, 3), 4.0, 4.936), ((0,), 4.936, 6.536), ((0,), 6.536, 7.336)]
    assert r.iteration_time == pytest.approx(7.336)


def test_powersgd_with_overlap_q_waits_for_p_and_the_network():
    # The compressed leaf exists at 2 s: P runs 2.0-3.6, Q follows at once
    # (3.6-4.4); the dense leaves are ready at 4 s but the network is busy until 4.4.
    r = simulate(
        PSGD, _net(bandwidth=1e3), Settings(powersgd_rank=4, powersgd_mask=None, overlap=True)
    )
    assert [c.kind for c in r.collectives] == ["P", "Q", "gradients"]
    assert [(c.ready, c.start, c.end) for c in r.collectives] == [
        (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(3.6)),
        (pytest.approx(3.6), pytest.approx(3.6), pytest.approx(4.4)),
        (pytest.approx(4.0), pytest.approx(4.4), pytest.approx(5.336)),
    ]
    assert r.iteration_time == pytest.approx(5.336)


def test_powersgd_wire_and_rank_clamp_and_boundary():
    # float16 halves every collective.
    r = simulate(
        PSGD,
        _net(bandwidth=1e3),
        Settings(powersgd_rank=4, powersgd_mask=None, wire_dtype="float16"),
    )
    assert [c.nbytes for c in r.collectives] == [468, 800, 400]
    # Rate 0.1: (2, 1000) (1002 x 4 x 0.1 <= 2000) at rank min(4, 2) = 2 is P 4,
    # Q 2000; (4, 4) (8 x 4 x 0.1 <= 16) at rank 4 is P 16, Q 16.
    # At rank 1, rate 2, (4, 4) sits on the boundary (8 x 2 = 16): compressed, P 4,
    # Q 4; (2, 1000) is not (1002 x 2 > 2000).
    w = Workload(
        (GradientTensor(2000, 0.0, shape=(2, 1000)), GradientTensor(16, 0.0, shape=(4, 4))),
        forward_time=0.0,
        batch=1,
    )
    r = simulate(w, _net(), Settings(powersgd_rank=4, powersgd_mask=None, min_compression_rate=0.1))
    assert [(c.kind, c.nbytes) for c in r.collectives] == [("P", 4 * (4 + 16)), ("Q", 4 * 2016)]
    r = simulate(w, _net(), Settings(powersgd_rank=1, powersgd_mask=None))
    assert [(c.kind, c.nbytes) for c in r.collectives] == [
        ("gradients", 4 * 2000),
        ("P", 4 * 4),
        ("Q", 4 * 4),
    ]


def test_powersgd_needs_every_shape():
    w = Workload((GradientTensor(100, 0.0),), forward_time=0.0, batch=1)
    with pytest.raises(ValueError, match="shape"):
        simulate(w, _net(), Settings(powersgd_rank=1))


# --- The simulator's payload against what jaxcomm itself counts. ---------------------


def _library_payload(tx, shapes):
    """payload_bytes of one step of ``tx`` on 8 CPU devices (jaxcomm's CommStats)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from tests.harness import mesh_of

    mesh = mesh_of((8,), ("data",))
    params = {k: jnp.ones(s) for k, s in shapes.items()}
    with jax.set_mesh(mesh):
        specs = jaxcomm.state_specs(jax.eval_shape(tx.init, params), "data")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs))

    def step(s, g):
        return tx.update(jax.tree.map(lambda a: a[0], g), s)[1]

    grads = jax.tree.map(lambda a: jnp.ones((8, *a.shape)), params)
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs))
    state = jax.block_until_ready(f(init(params), grads))
    return float(jaxcomm.get_stats(state).payload_bytes)


def _workload(shapes):
    # Leaves in tree order (sorted keys), backward order reversed.
    tensors = [GradientTensor(math.prod(s), 0.0, shape=s) for _, s in sorted(shapes.items())]
    return Workload(tuple(reversed(tensors)), forward_time=0.0, batch=1)


@pytest.mark.parametrize(
    "shapes",
    [
        {"w": (64, 48), "b": (48,), "conv": (16, 3, 3, 8), "small": (4, 4)},
        {"w": (64, 48), "v": (40, 64)},
    ],
)
def test_powersgd_payload_is_jaxcomms(shapes):
    import jaxcomm

    # Every matrix the size rule takes, compressed from the first step.
    tx = jaxcomm.powersgd("data", rank=3, start_step=0, mask=None, backend="xla")
    r = simulate(_workload(shapes), _net(p=8), Settings(powersgd_rank=3, powersgd_mask=None))
    assert sum(c.nbytes for c in r.collectives) == _library_payload(tx, shapes)


@pytest.mark.parametrize(
    "shapes",
    [
        # An LM's: the (vocab, width) embedding and (context, width) positions stay
        # dense under mask="auto"; the rank is each matrix's min(rows, cols) // 4.
        {"embed": (256, 64), "pos": (65, 64), "qkv": (64, 192), "out": (64, 64), "b": (64,)},
        {"w": (64, 48), "v": (48, 64), "c": (16, 3, 3, 8)},
    ],
)
def test_powersgd_defaults_payload_is_jaxcomms(shapes):
    import jaxcomm

    tx = jaxcomm.powersgd("data", start_step=0, backend="xla")  # the defaults, compressing
    r = simulate(_workload(shapes), _net(p=8), Settings(powersgd=True))
    assert sum(c.nbytes for c in r.collectives) == _library_payload(tx, shapes)
    # ... which the mask changed: without it the payload is another.
    unmasked = simulate(_workload(shapes), _net(p=8), Settings(powersgd=True, powersgd_mask=None))
    if "embed" in shapes:
        assert sum(c.nbytes for c in unmasked.collectives) < sum(c.nbytes for c in r.collectives)


@pytest.mark.parametrize("bucket_bytes", [0, math.inf])
def test_fp8_payload_is_jaxcomms(bucket_bytes):
    import jaxcomm

    shapes = {"w": (64, 32), "b": (32,), "c": (8, 8)}  # every leaf a multiple of 8 elements
    tx = jaxcomm.allreduce_gradients("data", wire_dtype="float8_e4m3fn", bucket_bytes=bucket_bytes)
    settings = Settings(wire_dtype="float8_e4m3fn", bucket_bytes=bucket_bytes)
    r = simulate(_workload(shapes), _net(p=8), settings)
    assert sum(c.nbytes for c in r.collectives) == _library_payload(tx, shapes)


@pytest.mark.parametrize("wire", ["int8", "int4"])
@pytest.mark.parametrize("bucket_bytes", [0, math.inf])
def test_integer_wire_payload_is_jaxcomms(wire, bucket_bytes):
    import jaxcomm

    shapes = {"w": (64, 33), "b": (33,), "c": (300,)}  # rows not whole chunks
    tx = jaxcomm.allreduce_gradients("data", wire_dtype=wire, bucket_bytes=bucket_bytes)
    settings = Settings(wire_dtype=wire, bucket_bytes=bucket_bytes)
    r = simulate(_workload(shapes), _net(p=8), settings)
    assert sum(c.nbytes for c in r.collectives) == _library_payload(tx, shapes)


def test_int4_wire_bytes_by_hand():
    # 2 ranks, 1000 elements: rows of 500, 250 bytes of codes; row 0 touches
    # chunks 0-1, row 1 chunks 1-3 (K = 3); the reduced rows have 2 chunks.
    # All-to-all 2 x (250 + 3 x 4), all-gather 2 x (250 + 2 x 4); one
    # latency for the all-to-all, one for the all-gather's ring.
    w = Workload((GradientTensor(1000, 0.0),), forward_time=0.0, batch=1)
    net = _net(p=2, bandwidth=1e6, latency=1e-3)
    r = simulate(w, net, Settings(wire_dtype="int4"))
    (c,) = r.collectives
    assert c.nbytes == (2 * 262 + 2 * 258) // 2
    assert r.iteration_time == pytest.approx(2e-3 + (262 + 258) / 1e6)


# --- DiLoCo ---------------------------------------------------------------------


def test_diloco_sends_the_whole_model_once_a_cycle():
    # TWO: 3 s of compute a step. H = 4: the 8e8 bytes (0.8 s, one bucket)
    # go after the 4th step's compute, at 12 s: a cycle of 12.8 s, 3.2 s a step.
    r = simulate(TWO, _net(), Settings(sync_every=4, bucket_bytes=math.inf))
    assert _starts(r) == [((0, 1), 12.0, 12.8)]
    assert [c.kind for c in r.collectives] == ["pseudo-gradient"]
    assert r.iteration_time == pytest.approx(3.2)
    assert r.communication_time == pytest.approx(0.8 / 4)
    half = simulate(TWO, _net(), Settings(sync_every=4, wire_dtype="float16"))
    assert half.iteration_time == pytest.approx((12 + 0.4) / 4)


def test_streaming_diloco_sends_each_fragment_at_its_offset():
    # F = 2 of H = 4: fragment 0 is the first leaf in tree order (B, backward
    # index 1), due after step 1 ((1 + 1) % 4 == 4 // 2); fragment 1 (A) after
    # step 3. Steps end at 3, 6 (+0.4 for B), 9.4, 12.4 (+0.4 for A).
    r = simulate(TWO, _net(), Settings(sync_every=4, fragments=2))
    assert _starts(r) == [((1,), 6.0, 6.4), ((0,), 12.4, 12.8)]
    assert r.iteration_time == pytest.approx(12.8 / 4)


def test_diloco_buckets_within_a_fragment_pay_a_latency_each():
    # 0.1 s latency: a 2-rank ring pays 2 per collective. H = 2, one fragment:
    # per leaf 2 x (0.4 + 0.2) s after 6 s of compute (backward order, as the
    # fusion plan goes), one bucket 0.8 + 0.2 s.
    net = _net(latency=0.1)
    per_leaf = simulate(TWO, net, Settings(sync_every=2, bucket_bytes=0.0))
    assert _starts(per_leaf) == [((0,), 6.0, 6.6), ((1,), 6.6, 7.2)]
    assert per_leaf.iteration_time == pytest.approx(7.2 / 2)
    fused = simulate(TWO, net, Settings(sync_every=2, bucket_bytes=math.inf))
    assert fused.iteration_time == pytest.approx(7.0 / 2)


def test_the_diloco_docs_example_runs_and_prints_what_it_says():
    """docs/diloco.md's cost example: run as written, with the value its
    comment gives."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "diloco.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "simulate(" in b]
    *lines, last = block.strip().splitlines()
    expr, comment = last.split("  # ")
    scope = {}
    exec("\n".join(lines), scope)
    assert f"{eval(expr, scope):.3f} s" == comment


# --- Streaming DiLoCo's delay and SparseLoCo -----------------------------------


@pytest.mark.parametrize(
    ("bandwidth", "delay", "overlap", "cycle"),
    [
        # TWO: 3 s of compute a step, H = 4, the model's 8e8 bytes in one bucket.
        (1e9, 1, False, 12.8),  # in its step, as jaxcomm runs it: as without a delay
        (1e9, 1, True, 12.0),  # 0.8 s hides under the next step
        # 8 s: the landing one step later waits 5 s (sync at T, lands at T + 8,
        # three more steps to the next sync at T + 17).
        (1e8, 1, True, 17.0),
        (1e8, 3, True, 12.0),  # three steps (9 s) hide all of it
        (1e8, 3, False, 20.0),
    ],
)
def test_a_delay_hides_the_sync_only_with_overlap(bandwidth, delay, overlap, cycle):
    settings = Settings(sync_every=4, bucket_bytes=math.inf, delay=delay, overlap=overlap)
    r = simulate(TWO, _net(bandwidth=bandwidth), settings)
    assert r.iteration_time == pytest.approx(cycle / 4)
    (c,) = r.collectives
    assert c.end - c.start == pytest.approx(8e8 / bandwidth)
    assert r.communication_time == pytest.approx(8e8 / bandwidth / 4)


def test_sparseloco_all_gather_grows_with_the_ranks():
    import jaxcomm
    from jaxcomm.transforms.sparseloco import payload_bytes

    outer = jaxcomm.sparse_outer(density=0.02, chunk_size=4096, exchange="all_gather")
    w = Workload((GradientTensor(1_000_000, 0.0),), forward_time=0.0, batch=1)
    payload = payload_bytes([1_000_000], chunk_size=4096, density=0.02, value_bits=2)
    for p in (2, 8, 64):
        r = simulate(w, _net(p=p, bandwidth=1e6), Settings(sync_every=1, sparse_outer=outer))
        (c,) = r.collectives
        assert c.kind == "sparse pseudo-gradient" and c.nbytes == payload
        # A ring all-gather of p rows: p - 1 steps of one row each.
        assert c.end - c.start == pytest.approx((p - 1) * payload / 1e6)
    dense = Settings(sync_every=1, sparse_outer=jaxcomm.sparse_outer(exchange="dense"))
    (c,) = simulate(w, _net(p=8), dense).collectives
    assert c.kind == "pseudo-gradient" and c.nbytes == 4_000_000


@pytest.mark.parametrize("exchange", ["auto", "all_gather", "dense"])
def test_sparseloco_payload_is_jaxcomms(exchange):
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxcomm
    from tests.harness import mesh_of
    from tests.test_diloco import _run_simple

    shapes = {"a": (5000,), "b": (300,), "c": (70, 70)}
    tx = jaxcomm.sparseloco(
        optax.sgd(0.1), "data", sync_every=1, density=0.03, exchange=exchange, bucket_bytes=0
    )
    params = {k: jnp.ones(s) for k, s in shapes.items()}
    rng = np.random.default_rng(0)
    grads = [{k: rng.standard_normal((8, *s)).astype(np.float32) for k, s in shapes.items()}]
    ((_, state),) = _run_simple(tx, mesh_of((8,), ("data",)), "data", params, grads)
    stats = jaxcomm.get_stats(state)
    outer = jaxcomm.sparse_outer(density=0.03, exchange=exchange)
    r = simulate(_workload(shapes), _net(p=8), Settings(sync_every=1, sparse_outer=outer))
    assert sum(c.nbytes for c in r.collectives) == float(stats.payload_bytes)
    assert len(r.collectives) == int(stats.collectives)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sync_every=4, delay=4),
        dict(sync_every=4, delay=-1),
        dict(delay=1),
        dict(sparse_outer="sparse"),
    ],
)
def test_bad_delay_and_sparse_settings(kwargs):
    with pytest.raises(ValueError, match="delay|sparse_outer"):
        Settings(**kwargs)


def test_sparse_outer_of_another_type_or_on_an_integer_wire_is_refused():
    import jaxcomm

    with pytest.raises(TypeError, match="sparse_outer="):
        Settings(sync_every=4, sparse_outer="sparse")
    with pytest.raises(ValueError, match="wire_dtype='int8'"):
        Settings(sync_every=4, wire_dtype="int8", sparse_outer=jaxcomm.sparse_outer())
