"""Property tests: random pytrees (scalars, zero-size leaves, odd shapes,
mixed float32/bfloat16/float16 leaves) and random options, against the NumPy
references.

Every new shape compiles a new program, so examples are few (and derandomized,
so a run is reproducible); each property still sweeps dtypes, shapes, wire
types, fusion thresholds, schedules, backends and device counts. The sweeps
take a minute, so they are in the slow tier; the fast tier checks the same
behaviours on fixed cases (test_allreduce, test_allreduce_gradients,
test_chunk_sparse)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.replicas import check_replicas, check_replicas_host
from tests.harness import mesh_of, run_steps
from tests.reference import EPS, error_bound

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), BF16, np.dtype(np.float16)]
SHAPES = [(), (0,), (1,), (3,), (7,), (8,), (33,), (5, 3), (2, 0, 3), (1, 1, 1), (17, 9)]
# Gap between the subnormals of each type: the absolute error floor of a cast.
TINY = {
    np.dtype(np.float32): 2.0**-149,
    BF16: 2.0**-133,
    np.dtype(np.float16): 2.0**-24,
}

PROPERTY = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# At least one leaf with elements: a shard_map whose operands all have zero
# elements does not compile in JAX 0.10.2 (Shardy: "expected at least one
# operand ... to be produced by a xla.sdy.GlobalToLocalShape"), jaxcomm or not.
leaves = st.lists(
    st.tuples(st.sampled_from(SHAPES), st.sampled_from(DTYPES)), min_size=1, max_size=4
).filter(lambda spec: any(math.prod(shape) > 0 for shape, _ in spec))
# (mesh shape, axis names, algorithm): flat meshes of 8 and of 3 devices,
# and 2 nodes x 4 devices for the hierarchical schedule.
topologies = st.sampled_from(
    [
        ((8,), ("data",), "auto"),
        ((8,), ("data",), "ring"),
        ((3,), ("data",), "auto"),
        ((2, 4), ("node", "local"), "hierarchical"),
    ]
)
options = st.fixed_dictionaries(
    {
        "backend": st.sampled_from(["xla", "ffi"]),
        "op": st.sampled_from(["mean", "sum"]),
        "wire_dtype": st.sampled_from([None, jnp.float16, jnp.bfloat16]),
        "bucket_bytes": st.sampled_from([0, 64, 1024, math.inf]),
    }
)


def _tree(spec, rng, rows=None):
    """{leaf name: array} for a list of (shape, dtype); values are standard
    normal rounded to the leaf's dtype (so the reference sees what was sent)."""
    out = {}
    for i, (shape, dtype) in enumerate(spec):
        full = shape if rows is None else (rows, *shape)
        out[f"l{i}"] = rng.standard_normal(full).astype(np.float32).astype(dtype)
    return out


def _axis(axes):
    return axes if len(axes) > 1 else axes[0]


def _one_step(tx, params, grads, mesh):
    """One update on every device; returns (updates with a leading device
    axis, check_replicas of the updates and of the new state)."""
    axes = tuple(mesh.axis_names)
    spec = P(axes)

    def step(g):
        g = jax.tree.map(lambda x: x[0], g)
        state = tx.init(params)
        updates, state = tx.update(g, state, params)
        diff = check_replicas((updates, jaxcomm.get_stats(state)), axes)
        return jax.tree.map(lambda x: x[None], updates), diff

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=(spec, P())))
    g = jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec)), grads)
    updates, diff = jax.block_until_ready(f(g))
    return jax.tree.map(np.asarray, updates), jax.tree.map(np.asarray, diff)


def _stated_bound(xs, op, wire, dtype, *, psum_path=False):
    """tests/reference.error_bound for the coarser of the wire and the leaf
    type, plus (N+1) subnormal gaps of the narrowest type involved (casts of
    values near zero are off by up to one gap, whatever their magnitude).

    psum_path: the reduction is XLA's float16 lax.psum (xla backend, auto or
    hierarchical), where a float16 mean is prescaled by 2^-k instead of 1/N,
    2^k the least power of two >= 2N, and scaled by 2^k/N afterwards: each
    term's gap is worth 2^k/N times more in the result."""
    types = [dtype] + ([np.dtype(wire)] if wire is not None else [])
    coarse = max(types, key=lambda t: EPS[t])
    n = xs.shape[0]
    tiny = max(TINY[t] for t in types)
    gaps = (n + 1) * (n if op == "sum" else 1)
    if psum_path and op == "mean" and wire is not None and np.dtype(wire) == np.float16:
        gaps *= 2 ** math.ceil(math.log2(2 * n)) / n
    return error_bound(xs, op, coarse, dtype) + gaps * tiny


@PROPERTY
@pytest.mark.slow
@given(spec=leaves, topology=topologies, opts=options, seed=st.integers(0, 2**16))
def test_dense_reduction_is_the_float64_mean_on_every_device(spec, topology, opts, seed):
    shape, axes, algorithm = topology
    mesh = mesh_of(shape, axes)
    rng = np.random.default_rng(seed)
    params = _tree(spec, rng)
    grads = _tree(spec, rng, rows=mesh.size)
    tx = jaxcomm.allreduce_gradients(_axis(axes), algorithm=algorithm, **opts)
    updates, diff = _one_step(tx, params, grads, mesh)

    assert int(diff.worst()[1]) == 0, f"replicas differ: {diff}"
    for k, g in grads.items():
        u = updates[k]
        assert u.dtype == g.dtype and u.shape == g.shape, k
        want = g.astype(np.float64).sum(0)
        if opts["op"] == "mean":
            want = want / mesh.size
        err = np.abs(u[0].astype(np.float64) - want)
        psum_path = opts["backend"] == "xla" and algorithm in ("auto", "hierarchical")
        bound = _stated_bound(g, opts["op"], opts["wire_dtype"], g.dtype, psum_path=psum_path)
        assert np.all(err <= bound), (k, g.dtype, np.max(err - bound))


@PROPERTY
@pytest.mark.slow
@given(
    spec=leaves,
    backend=st.sampled_from(["xla", "ffi"]),
    wire=st.sampled_from([None, jnp.float16, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_double_buffering_is_dense_shifted_by_one_step(spec, backend, wire, seed):
    mesh = mesh_of((8,), ("data",))
    rng = np.random.default_rng(seed)
    params = _tree(spec, rng)
    grads = [_tree(spec, rng, rows=8) for _ in range(3)]
    opts = dict(backend=backend, wire_dtype=wire)
    dense, _, _ = run_steps(jaxcomm.allreduce_gradients("data", **opts), params, grads, mesh)
    db, _, state = run_steps(
        jaxcomm.allreduce_gradients("data", double_buffering=True, **opts), params, grads, mesh
    )
    for k in params:
        assert db[0][k].dtype == grads[0][k].dtype
        np.testing.assert_array_equal(db[0][k], np.zeros_like(db[0][k]))
        for t in (1, 2):
            np.testing.assert_array_equal(db[t][k], dense[t - 1][k])
    # The buffer is per device: each device's own gradient of the last step.
    for k in params:
        np.testing.assert_array_equal(state.buffer.value[k][:, 0], grads[-1][k])


@PROPERTY
@pytest.mark.slow
@given(
    spec=leaves,
    theta=st.sampled_from([64, 1024, math.inf]),
    wire=st.sampled_from([None, jnp.float16, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_fused_equals_unfused(spec, theta, wire, seed):
    """ffi's direct schedule adds every element over ranks in rank order,
    whatever bucket it travels in, so fusion changes no bit; lax.psum may
    add in another order, so xla is held to the stated bound instead."""
    mesh = mesh_of((8,), ("data",))
    rng = np.random.default_rng(seed)
    params = _tree(spec, rng)
    grads = [_tree(spec, rng, rows=8)]
    out = {}
    for backend in ("ffi", "xla"):
        for bucket_bytes in (0, theta):
            tx = jaxcomm.allreduce_gradients(
                "data", backend=backend, wire_dtype=wire, bucket_bytes=bucket_bytes
            )
            out[backend, bucket_bytes] = run_steps(tx, params, grads, mesh)[0][0]
    for k, g in grads[0].items():
        np.testing.assert_array_equal(out["ffi", theta][k], out["ffi", 0][k])
        err = np.abs(out["xla", theta][k].astype(np.float64) - out["xla", 0][k].astype(np.float64))
        assert np.all(err <= 2 * _stated_bound(g, "mean", wire, g.dtype, psum_path=True)), k


@PROPERTY
@pytest.mark.slow
@given(
    spec=leaves,
    backend=st.sampled_from(["xla", "ffi"]),
    density=st.sampled_from([0.3, 1.0]),
    chunk_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_chunk_sparse_keeps_dtypes_and_replicas(spec, backend, density, chunk_size, seed):
    """chunk_sparse over random trees: dtypes and shapes survive, parameters
    and shared state stay bitwise identical across devices, and at density 1
    the parameters follow SGD on the float64 mean within the stated bound."""
    mesh = mesh_of((8,), ("data",))
    rng = np.random.default_rng(seed)
    params = _tree(spec, rng)
    grads = [_tree(spec, rng, rows=8) for _ in range(2)]
    tx = jaxcomm.chunk_sparse(
        optax.sgd(0.5), "data", density=density, chunk_size=chunk_size, backend=backend
    )
    _, p, state = run_steps(tx, params, grads, mesh)
    for k in params:
        assert p[k].dtype == params[k].dtype and p[k].shape[1:] == params[k].shape, k
    assert int(check_replicas_host(p).worst()[1]) == 0
    shared = (state.inner, state.mask, state.count)
    assert int(check_replicas_host(shared).worst()[1]) == 0
    if density == 1.0:
        for k, w in params.items():
            want = w.astype(np.float64)
            bound = 0.0
            for g in grads:
                want = want - 0.5 * g[k].astype(np.float64).mean(0)
                bound = bound + 0.5 * _stated_bound(g[k], "mean", None, g[k].dtype)
            # plus one rounding of the parameter per step
            bound = bound + 2 * 2 * EPS[w.dtype] * (np.abs(want) + 1)
            err = np.abs(p[k][0].astype(np.float64) - want)
            assert np.all(err <= bound), (k, w.dtype, np.max(err - bound))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_replicas_sees_one_flipped_bit(dtype):
    """The replica check itself: one device with one bit changed in one
    element is found, on the device and on the host, with its distance."""
    mesh = mesh_of((8,), ("data",))
    rows = np.ones((8, 5), dtype)
    bits = rows.view(f"u{rows.itemsize}")
    bits[6, 3] ^= 1  # last mantissa bit of one element on device 6
    want = float(np.abs(rows[6, 3].astype(np.float64) - 1.0))

    def check(x):
        return check_replicas({"x": x[0], "same": x[0, :2] * 0}, "data")

    f = jax.jit(jax.shard_map(check, mesh=mesh, in_specs=P("data"), out_specs=P()))
    diff = f(jax.device_put(jnp.asarray(rows), NamedSharding(mesh, P("data"))))
    host = check_replicas_host({"x": rows, "same": rows[:, :2] * 0})
    for d in (diff, host):
        assert int(d.mismatches["x"]) == 1 and int(d.mismatches["same"]) == 0
        assert float(d.max_abs_diff["x"]) == want > 0
        assert float(d.worst()[0]) == want


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_chunk_sparse_on_a_tree_without_elements(backend):
    """Found by test_chunk_sparse_keeps_dtypes_and_replicas. Traced only
    (the failure is at trace time): one empty leaf, the update is empty."""
    mesh = mesh_of((8,), ("data",))
    tx = jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.5, chunk_size=4, backend=backend)
    params = {"w": jnp.zeros((0,), jnp.float32)}

    def step(x):
        state = tx.init(params)
        updates, _ = tx.update(params, state, params)
        return x, updates["w"]

    f = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P()))
    x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    _, out = jax.eval_shape(f, x)
    assert out.shape == (0,)
