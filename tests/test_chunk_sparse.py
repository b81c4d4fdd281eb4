"""chunk_sparse against a NumPy float64 GradientFlow Algorithm 1, on 8 CPU devices."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from tests.harness import assert_same_on_all_devices, mesh_of, random_grads, run_steps

N = 8
SHAPES = {"a": (70,), "b": (13, 11)}  # pool = [b, a] (reverse tree order), 213 elements
C = 16  # 14 chunks, the last one of 5 elements
LR, MU = 0.05, 0.9


@pytest.fixture
def mesh():
    return mesh_of((N,), ("data",))


def _params():
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _pool(tree) -> np.ndarray:
    """Leaves in reverse tree order, flattened."""
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.reshape(x, (-1,)) for x in reversed(leaves)])


def _pool_rows(tree) -> np.ndarray:
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.reshape(x, (x.shape[0], -1)) for x in reversed(leaves)], axis=1)


def _chunk_l1(x: np.ndarray, nchunks: int) -> np.ndarray:
    pad = np.zeros(nchunks * C - x.shape[-1])
    return np.abs(np.concatenate([x, pad])).reshape(nchunks, C).sum(1)


def algorithm1(w0, grads, *, density, warmup, decay=MU):
    """GradientFlow Algorithm 1 with momentum SGD, in NumPy float64, written
    from the paper: u = mu*u + lr*g; w -= u on important chunks only.

    Returns per-step (params pool, mask used at that step)."""
    w = w0.astype(np.float64)
    size = w.size
    nchunks = -(-size // C)
    u = np.zeros(size)
    hg = np.zeros((N, size))
    mask = np.ones(nchunks, bool)
    out = []
    for t, g in enumerate(grads):
        g = g.astype(np.float64) + hg
        em = np.repeat(mask, C)[:size]
        ex = np.where(em, g.mean(0), 0.0)
        hg = np.where(em, 0.0, decay * g)
        u = np.where(em, MU * u + LR * ex, u)
        w = w - np.where(em, u, 0.0)
        out.append((w.copy(), mask.copy()))
        norms = sum(_chunk_l1(np.where(em, 0.0, g[i]), nchunks) for i in range(N))
        norms = norms + _chunk_l1(ex, nchunks)  # N devices x |average| / N
        d = 1 + (density - 1) * min(t + 1, warmup) / warmup if warmup else density
        k = min(max(math.ceil(d * nchunks - 1e-6), 1), nchunks)
        mask = np.zeros(nchunks, bool)
        mask[np.argsort(-norms, kind="stable")[:k]] = True
    return out


@pytest.mark.parametrize("backend", ["ffi", "xla"])
@pytest.mark.parametrize("warmup", [0, 5])
def test_momentum_sgd_is_algorithm1_step_by_step(mesh, backend, warmup):
    steps = 20
    grads = random_grads(np.random.default_rng(0), SHAPES, N, steps)
    tx = jaxcomm.chunk_sparse(
        optax.sgd(LR, momentum=MU),
        "data",
        density=0.3,
        chunk_size=C,
        warmup_steps=warmup,
        backend=backend,
    )
    want = algorithm1(_pool(_params()), [_pool_rows(g) for g in grads], density=0.3, warmup=warmup)
    # One run, checking masks as they are produced: after step t the state
    # holds the mask for step t+1.
    seen = []
    run_steps(tx, _params(), grads, mesh, each_step=lambda p, s: seen.append((p, s)))
    assert len(seen) == steps
    for t, (p, s) in enumerate(seen):
        np.testing.assert_allclose(_pool_rows(p)[0], want[t][0], rtol=1e-5, atol=1e-5)
        if t + 1 < steps:
            np.testing.assert_array_equal(s.mask[0], want[t + 1][1])
        assert_same_on_all_devices(p, "params")
        assert_same_on_all_devices((s.inner, s.mask, s.count), "state")
    # Density follows the warm-up ramp: 1 at step 0, 0.3 (5 of 14) at the end.
    chunks = [int(m.sum()) for _, m in want]
    assert chunks[0] == 14 and chunks[-1] == 5
    if warmup:
        assert chunks[1] == math.ceil((1 - 0.7 / 5) * 14 - 1e-6)


def test_density_one_is_dense_momentum_sgd(mesh):
    grads = random_grads(np.random.default_rng(1), SHAPES, N, 10)
    opt = optax.sgd(LR, momentum=MU)
    sparse = jaxcomm.chunk_sparse(opt, "data", density=1.0, chunk_size=C, backend="ffi")
    dense = optax.chain(jaxcomm.allreduce_gradients("data", backend="ffi"), opt)
    _, p_sparse, s = run_steps(sparse, _params(), grads, mesh)
    _, p_dense, _ = run_steps(dense, _params(), grads, mesh)
    for k in SHAPES:
        np.testing.assert_allclose(p_sparse[k], p_dense[k], rtol=1e-6, atol=1e-6)
    assert not np.any(s.residual.value)  # nothing is ever left behind


def test_adam_state_is_held_on_unimportant_chunks(mesh):
    """The same contract with Adam: NumPy replays optax.adam on the averaged
    important chunks and holds mu/nu elsewhere."""
    steps = 8
    grads = random_grads(np.random.default_rng(2), SHAPES, N, steps)
    density, b1, b2, eps, lr = 0.25, 0.9, 0.999, 1e-8, 1e-2
    tx = jaxcomm.chunk_sparse(
        optax.adam(lr, b1=b1, b2=b2, eps=eps), "data", density=density, chunk_size=C
    )
    _, p, s = run_steps(tx, _params(), grads, mesh)

    w = _pool(_params()).astype(np.float64)
    size = w.size
    nchunks = -(-size // C)
    m, v, hg, mask = np.zeros(size), np.zeros(size), np.zeros((N, size)), np.ones(nchunks, bool)
    for t, g in enumerate(grads):
        g = _pool_rows(g).astype(np.float64) + hg
        em = np.repeat(mask, C)[:size]
        ex = np.where(em, g.mean(0), 0.0)
        hg = np.where(em, 0.0, MU * g)
        m = np.where(em, b1 * m + (1 - b1) * ex, m)
        v = np.where(em, b2 * v + (1 - b2) * ex**2, v)
        step = -lr * (m / (1 - b1 ** (t + 1))) / (np.sqrt(v / (1 - b2 ** (t + 1))) + eps)
        w = w + np.where(em, step, 0.0)
        norms = sum(_chunk_l1(np.where(em, 0.0, g[i]), nchunks) for i in range(N))
        norms = norms + _chunk_l1(ex, nchunks)
        mask = np.zeros(nchunks, bool)
        mask[np.argsort(-norms, kind="stable")[: math.ceil(density * nchunks)]] = True
    np.testing.assert_allclose(_pool_rows(p)[0], w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_pool_rows(s.inner[0].mu)[0], m, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(s.mask[0], mask)


def test_stats_count_what_travels(mesh):
    """At density d the exchanged payload is d of the dense payload (here 5
    of 14 chunks, all full), plus the norm exchange: one float32 per chunk."""
    shapes = {"w": (14 * C,)}
    grads = random_grads(np.random.default_rng(3), shapes, N, 3)
    dense_payload = 14 * C * 4
    for backend in ("ffi", "xla"):
        tx = jaxcomm.chunk_sparse(
            optax.sgd(0.1), "data", density=5 / 14, chunk_size=C, backend=backend
        )
        for steps, chunks in ((1, 14), (2, 5), (3, 5)):  # step 0 sends every chunk
            _, _, s = run_steps(tx, {"w": np.zeros(14 * C, np.float32)}, grads[:steps], mesh)
            st = jax.tree.map(lambda x: x[0], s.stats)
            assert st.payload_bytes == chunks / 14 * dense_payload + 14 * 4
            assert st.bytes_sent == np.float32((chunks * C * 4 + 14 * 4) * 2 * (N - 1) / N)
            assert st.density == np.float32(chunks / 14) and st.collectives == 2

    half = jaxcomm.chunk_sparse(
        optax.sgd(0.1), "data", density=5 / 14, chunk_size=C, wire_dtype=jnp.float16
    )
    _, _, s = run_steps(half, {"w": np.zeros(14 * C, np.float32)}, grads[:2], mesh)
    assert s.stats.payload_bytes[0] == 5 / 14 * dense_payload / 2 + 14 * 4


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_nonfinite_step_is_skipped_on_every_device(mesh, inner):
    """An inf on one device, in an unimportant chunk, reaches the norms; in an
    important one, the average. Either way every device skips the step, and
    the inner state is held whole: parameter-shaped leaves (momentum, Adam's
    moments) and the rest (Adam's step count) alike."""
    grads = random_grads(np.random.default_rng(4), SHAPES, N, 4)
    grads[2]["a"][3, 0] = np.inf
    opt = optax.sgd(LR, momentum=MU) if inner == "sgd" else optax.adam(LR)
    tx = jaxcomm.chunk_sparse(opt, "data", density=0.3, chunk_size=C)
    _, p2, s2 = run_steps(tx, _params(), grads[:2], mesh)
    _, p3, s3 = run_steps(tx, _params(), grads[:3], mesh)
    assert s3.stats.nonfinite.all() and not s2.stats.nonfinite.any()
    for a, b in zip(
        jax.tree.leaves((p2, s2._replace(stats=()))),
        jax.tree.leaves((p3, s3._replace(stats=()))),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_nonfinite_in_an_exchanged_chunk_skips_the_step(mesh, backend, bad):
    """Step 0 exchanges every chunk, so a NaN or -inf on one device lands in
    the averaged chunks: the step is flagged and skipped everywhere, leaving
    params and state as they were."""
    grads = random_grads(np.random.default_rng(6), SHAPES, N, 1)
    grads[0]["b"][5, 2, 3] = bad
    tx = jaxcomm.chunk_sparse(
        optax.sgd(LR, momentum=MU), "data", density=0.3, chunk_size=C, backend=backend
    )
    params = _params()
    _, p, s = run_steps(tx, params, grads, mesh)
    assert s.stats.nonfinite.all()
    assert (s.count == 0).all() and s.mask.all()
    np.testing.assert_array_equal(s.residual.value, 0)
    for name, value in params.items():
        np.testing.assert_array_equal(p[name], np.broadcast_to(value, p[name].shape))


def test_under_pmap_with_mixed_dtypes():
    shapes = {"a": (40,), "b": (30,)}
    rng = np.random.default_rng(5)
    params = {"a": np.zeros(40, jnp.bfloat16), "b": np.zeros(30, np.float32)}
    tx = jaxcomm.chunk_sparse(optax.sgd(0.1), "i", density=0.5, chunk_size=8, backend="xla")

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), params)
    s = jax.pmap(tx.init, axis_name="i")(p)
    run = jax.pmap(step, axis_name="i")
    for _ in range(3):
        g = {k: rng.standard_normal((N, *sh)).astype(params[k].dtype) for k, sh in shapes.items()}
        p, s = jax.block_until_ready(run(p, s, g))
    assert p["a"].dtype == jnp.bfloat16 and np.asarray(s.mask).shape == (N, 9)
    assert_same_on_all_devices(jax.tree.map(np.asarray, (p, s.mask, s.inner)), "pmap state")


BAD = [
    (dict(density=0.0), ValueError, "density=0.0 must be in (0, 1]"),
    (dict(density=1.5), ValueError, "density=1.5"),
    (dict(density=0.1, chunk_size=0), ValueError, "chunk_size=0"),
    (dict(density=0.1, warmup_steps=-1), ValueError, "warmup_steps=-1"),
    (dict(density=0.1, residual_decay=2.0), ValueError, "residual_decay=2.0"),
    (dict(density=0.1, backend="nccl"), ValueError, "backend='nccl'"),
    (dict(density=0.1, wire_dtype=jnp.int32), TypeError, "wire_dtype=int32"),
]


@pytest.mark.parametrize("options,error,message", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_options_fail_at_construction(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        jaxcomm.chunk_sparse(optax.sgd(0.1), "data", **options)
