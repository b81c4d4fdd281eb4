"""allreduce against NumPy float64, for every backend x algorithm x wire x
input dtype, N in {1, 2, 3, 4, 8}, odd sizes, shard_map (jit and eager) and pmap."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference

import jaxcomm
from tests.harness import assert_same_on_all_devices as assert_replicated
from tests.harness import mesh_of, run_pmap, run_sharded

BF16 = np.dtype(ml_dtypes.bfloat16)
INPUT_DTYPES = [np.float32, np.float16, BF16, np.float64]
WIRES = [None, np.float16, BF16]
# (backend, algorithm); "hierarchical" runs on a 2-D mesh (inter, intra).
SCHEDULES = [
    ("xla", "auto"),
    ("xla", "ring"),
    ("xla", "hierarchical"),
    ("ffi", "direct"),
    ("ffi", "ring"),
    ("ffi", "hierarchical"),
]
HIER_SHAPE = {1: (1, 1), 2: (2, 1), 3: (1, 3), 4: (2, 2), 8: (2, 4)}


def sizes_for(n: int, dtype=np.float32) -> list:
    """Shapes that stress the chunking: scalar, fewer elements than ranks,
    sizes not divisible by N, and a few thousand elements. The chunking does
    not depend on the dtype, so the other dtypes take three of them (an
    xla ring compiles in about a second per array at N = 8)."""
    if np.dtype(dtype) != np.float32:
        return [(), (max(n - 1, 1),), (4099,)]
    return [(), (1,), (max(n - 1, 1),), (7,), (3, 5), (4099,)]


def mesh_for(n: int, algorithm: str):
    if algorithm == "hierarchical":
        return mesh_of(HIER_SHAPE[n], ("inter", "intra"))
    return mesh_of((n,), ("i",))


def random_inputs(rng, n, shapes, dtype):
    return [rng.standard_normal((n, *s)).astype(dtype) for s in shapes]


def check(outs, inputs, op, wire, dtype):
    for out, xs in zip(outs, inputs, strict=True):
        assert out.dtype == np.dtype(dtype)
        assert out.shape == xs.shape
        assert_replicated(out)
        want = reference.allreduce64(xs.reshape(xs.shape[0], -1), op)
        bound = reference.error_bound(xs.reshape(xs.shape[0], -1), op, wire or dtype, dtype)
        got = out.reshape(out.shape[0], -1).astype(np.float64)
        err = np.abs(got - want)
        assert (err <= bound).all(), f"max err {err.max():.3g}, bound {bound.max():.3g}"


# N = 2 and 4 take the code paths of N = 8 on other sizes: in the slow tier.
DEVICE_COUNTS = [1, 3, 8, *(pytest.param(n, marks=pytest.mark.slow) for n in (2, 4))]


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("backend,algorithm", SCHEDULES)
@pytest.mark.parametrize("wire", WIRES, ids=lambda w: "wire-" + (np.dtype(w).name if w else "none"))
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_allreduce_matches_float64(n, backend, algorithm, wire, dtype):
    rng = np.random.default_rng(abs(hash((n, backend, algorithm, str(wire), str(dtype)))) % 2**32)
    mesh = mesh_for(n, algorithm)
    axes = tuple(mesh.axis_names)
    op = "mean" if n % 2 else "sum"  # both ops across the matrix
    inputs = random_inputs(rng, n, sizes_for(n, dtype), dtype)

    def fn(*xs):
        return [
            jaxcomm.allreduce(x, axes, op=op, algorithm=algorithm, backend=backend, wire_dtype=wire)
            for x in xs
        ]

    with jax.enable_x64(np.dtype(dtype) == np.float64):
        outs = run_sharded(fn, mesh, *inputs)
    check(outs, inputs, op, wire, dtype)


@pytest.mark.parametrize("backend,algorithm", [("ffi", "direct"), ("ffi", "ring"), ("xla", "ring")])
@pytest.mark.parametrize("wire", WIRES, ids=lambda w: "wire-" + (np.dtype(w).name if w else "none"))
@pytest.mark.parametrize("n", [1, 3, 8])
def test_schedule_bitwise_equals_numpy_replay(backend, algorithm, wire, n):
    """float32 input: the result is exactly what NumPy float32 arithmetic gives
    when it replays the schedule, wire rounding included."""
    rng = np.random.default_rng(n)
    xs = rng.standard_normal((n, 1001)).astype(np.float32)
    mesh = mesh_of((n,), ("i",))
    out = run_sharded(
        lambda x: jaxcomm.allreduce(
            x, "i", op="mean", algorithm=algorithm, backend=backend, wire_dtype=wire
        ),
        mesh,
        xs,
    )
    narrow = wire is not None
    pre, post = (1.0 / n, 1.0) if narrow else (1.0, 1.0 / n)
    replay = reference.direct_float32 if algorithm == "direct" else reference.ring_float32
    want = replay(xs, wire or np.float32, pre, post)
    np.testing.assert_array_equal(out[0], want)
    assert_replicated(out)


@pytest.mark.parametrize("backend,algorithm", [("ffi", "direct"), ("ffi", "ring"), ("xla", "auto")])
@pytest.mark.parametrize("wire", [None, np.float16], ids=["wire-none", "wire-float16"])
def test_pmap(backend, algorithm, wire):
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((8, 33)).astype(np.float32)
    out = run_pmap(
        lambda x: jaxcomm.allreduce(x, "i", algorithm=algorithm, backend=backend, wire_dtype=wire),
        8,
        xs,
    )
    check([out], [xs], "sum", wire, np.float32)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_eager_shard_map(backend):
    xs = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
    out = run_sharded(
        lambda x: jaxcomm.allreduce(x, "i", backend=backend), mesh_of((8,), ("i",)), xs, jit=False
    )
    np.testing.assert_array_equal(out, np.broadcast_to(xs.sum(0), xs.shape))


@pytest.mark.parametrize("backend", ["ffi", "xla"])
@pytest.mark.parametrize("axis", ["a", "b", ("a", "b"), ("b", "a")])
def test_reduce_over_some_axes(backend, axis):
    """On a (2, 4) mesh, reducing over one axis runs one ring per group of
    the other axis; a tuple reduces over both, in the tuple's rank order."""
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((8, 10)).astype(np.float32)
    mesh = mesh_of((2, 4), ("a", "b"))
    out = run_sharded(lambda x: jaxcomm.allreduce(x, axis, backend=backend), mesh, xs)
    grid = xs.astype(np.float64).reshape(2, 4, 10)
    if axis == "a":
        want = np.broadcast_to(grid.sum(0, keepdims=True), grid.shape)
    elif axis == "b":
        want = np.broadcast_to(grid.sum(1, keepdims=True), grid.shape)
    else:
        want = np.broadcast_to(grid.sum((0, 1), keepdims=True), grid.shape)
    np.testing.assert_allclose(out.reshape(2, 4, 10), want, rtol=1e-6, atol=1e-6)


# max_chunks: only the first that many selected chunks are reduced, on every
# backend; without it ffi on CPU packs exactly what is selected.
@pytest.mark.parametrize("unselected", ["local", "zero"])
@pytest.mark.parametrize(
    "backend,max_chunks", [("ffi", None), ("ffi", 2), ("xla", None), ("xla", 3), ("xla", 2)]
)
def test_chunk_mask(backend, max_chunks, unselected):
    """Selected chunks (the first `max_chunks` of them) are reduced; the
    others keep each device's own values, or are zero."""
    rng = np.random.default_rng(11)
    n, chunk = 8, 4
    xs = rng.standard_normal((n, 4 * chunk + 3)).astype(np.float32)  # 5 chunks, last short
    mask = np.array([True, False, False, True, True])
    out = run_sharded(
        lambda x: jaxcomm.allreduce(
            x,
            "i",
            backend=backend,
            chunk_mask=jnp.asarray(mask),
            chunk_size=chunk,
            max_chunks=max_chunks,
            unselected=unselected,
        ),
        mesh_of((n,), ("i",)),
        xs,
    )
    reduced = mask & (np.cumsum(mask) <= (max_chunks or mask.size))
    selected = np.repeat(reduced, chunk)[: xs.shape[1]]
    rest = xs if unselected == "local" else np.zeros_like(xs)
    want = np.where(selected, xs.astype(np.float64).sum(0), rest)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert_replicated(out[:, selected])


def test_masked_ffi_sends_only_selected_chunks():
    n, chunk = 8, 64
    xs = np.ones((n, 10 * chunk), np.float32)
    mask = np.zeros(10, bool)
    mask[[2, 7]] = True
    jaxcomm.reset_ffi_stats()
    run_sharded(
        lambda x: jaxcomm.allreduce(
            x, "i", backend="ffi", chunk_mask=jnp.asarray(mask), chunk_size=chunk
        ),
        mesh_of((n,), ("i",)),
        xs,
    )
    stats = jaxcomm.ffi_stats()
    packed_bytes = 2 * chunk * 4
    total = sum(s["bytes_sent"] for s in stats.values())
    # All ranks together send 2(N-1)/N of the packed payload each, N times.
    assert total == 2 * (n - 1) * packed_bytes


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_wire_byte_counters(algorithm):
    """Each device sends 2(N-1)/N of the payload, in the wire dtype's bytes."""
    n, size = 8, 800
    xs = np.ones((n, size), np.float32)
    for wire, width in [(None, 4), (np.float16, 2)]:
        jaxcomm.reset_ffi_stats()
        run_sharded(
            lambda x, wire=wire: jaxcomm.allreduce(
                x, "i", backend="ffi", algorithm=algorithm, wire_dtype=wire
            ),
            mesh_of((n,), ("i",)),
            xs,
        )
        stats = jaxcomm.ffi_stats()
        assert sorted(stats) == list(range(n))
        for s in stats.values():
            assert s["calls"] == 1
            assert s["bytes_sent"] == 2 * (n - 1) * (size // n) * width


def test_results_identical_across_schedules_for_exact_inputs():
    """Small integers are exact in every wire dtype: all schedules agree exactly."""
    xs = np.arange(8 * 40, dtype=np.float32).reshape(8, 40) % 7
    mesh = mesh_of((2, 4), ("inter", "intra"))
    results = []
    for backend, algorithm in SCHEDULES:
        for wire in WIRES:
            out = run_sharded(
                lambda x, b=backend, a=algorithm, w=wire: jaxcomm.allreduce(
                    x, ("inter", "intra"), backend=b, algorithm=a, wire_dtype=w
                ),
                mesh,
                xs,
            )
            results.append(out)
    for a, b in itertools.pairwise(results):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(results[0][0], xs.sum(0))
