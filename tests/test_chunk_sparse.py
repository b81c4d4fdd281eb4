"""chunk_sparse against a NumPy float64 GradientFlow Algorithm 1, on 8 CPU devices."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import hlo
from tests.harness import (
    OTHER_JOB,
    assert_same_on_all_devices,
    mesh_of,
    random_grads,
    run_steps,
    run_updates,
    update_step,
)

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


# chunk_sparse(double_buffering=True): chunk_sparse run one step late, bitwise,
# whether its exchange runs in the step or travels between steps (started at a
# step's end, finished in the next).


def _forged(state):
    """The state with its handle another job's (a state restored by a new process)."""
    return state._replace(handle=np.asarray(state.handle) + OTHER_JOB)


def _tx(double_buffering, **options):
    """Momentum SGD in chunk_sparse (density 0.3), in the step or one step late."""
    return jaxcomm.chunk_sparse(
        optax.sgd(0.05, momentum=0.9),
        "data",
        density=0.3,
        chunk_size=C,
        residual_decay=MU,
        double_buffering=double_buffering,
        **options,
    )


def _assert_one_step_late(late, late_states, now, now_states):
    """Step t+1 of the late run is step t of chunk_sparse, bitwise: its
    update, the mask it chose next and the exchanges it applied."""
    for k in SHAPES:
        np.testing.assert_array_equal(late[0][k], np.zeros(SHAPES[k], np.float32))
    for t in range(len(now) - 1):
        for k in SHAPES:
            np.testing.assert_array_equal(late[t + 1][k], now[t][k], err_msg=f"step {t + 1} {k}")
        np.testing.assert_array_equal(late_states[t + 1].mask, now_states[t].mask)
        assert int(late_states[t + 1].count) == int(now_states[t].count) == t + 1


@pytest.mark.parametrize(
    "backend,wire,warmup",
    [("ffi", None, 0), ("ffi", jnp.bfloat16, 3), ("xla", None, 3)],
)
def test_in_the_step_it_is_chunk_sparse_one_step_late(mesh, backend, wire, warmup):
    """In one process the exchange runs in the step (no handle): the same
    bits as chunk_sparse's of the step before, mask by mask."""
    grads = random_grads(np.random.default_rng(0), SHAPES, N, 7)
    options = dict(backend=backend, wire_dtype=wire, warmup_steps=warmup)
    now, now_states, _ = run_updates(_tx(False, **options), _params(), grads, mesh)
    late, late_states, in_flight = run_updates(_tx(True, **options), _params(), grads, mesh)
    assert late_states[0].handle == ()
    assert in_flight == [0] * len(grads)
    _assert_one_step_late(late, late_states, now, now_states)
    # The first step applies nothing and sends every chunk; then the density's.
    assert float(late_states[0].stats.density) == 0
    assert late_states[0].mask.all()
    assert int(late_states[-1].mask.sum()) == 5  # ceil(0.3 * 14)


@pytest.mark.parametrize("wire", [None, jnp.float16])
def test_started_exchange_travels_between_steps(mesh, wire, started_in_one_process):
    """ffi on CPU, started: each step leaves its masked exchange in flight
    (one per device) for the next step to finish, to the same bits as
    chunk_sparse's of the step before; a state whose handle this job did not
    start reduces the pool it kept, in the step, to the same bits."""
    grads = random_grads(np.random.default_rng(1), SHAPES, N, 6)
    now, now_states, _ = run_updates(
        _tx(False, backend="ffi", wire_dtype=wire), _params(), grads, mesh
    )
    for forge_at in (None, 2):
        late, late_states, in_flight = run_updates(
            _tx(True, backend="ffi", wire_dtype=wire),
            _params(),
            grads,
            mesh,
            before_step=lambda t, s, at=forge_at: _forged(s) if t == at else s,
        )
        left = [int(forge_at is not None and t >= forge_at) for t in range(len(grads))]
        assert in_flight == [(1 + x) * N for x in left]
        _assert_one_step_late(late, late_states, now, now_states)
        # Only the selected chunks travel: the density's, in the stats.
        itemsize = 4 if wire is None else 2
        selected = now_states[2].stats.density * 213
        assert float(late_states[3].stats.payload_bytes) == selected * itemsize + 14 * 4


def test_nonfinite_exchange_is_skipped_a_step_late(mesh, started_in_one_process):
    """A NaN in one device's gradient at step 2 reaches the exchange that
    step 3 finishes: step 3 applies nothing on any device, keeps the mask and
    the count, drops the residual (pool 3 is step 3's gradient alone) and
    sends the same chunks again; step 4 goes on, finite."""
    grads = random_grads(np.random.default_rng(2), SHAPES, N, 6)
    grads[2]["a"][5, 3] = np.nan
    _, clean, _ = run_updates(_tx(True, backend="ffi"), _params(), grads[:2], mesh)
    late, states, _ = run_updates(_tx(True, backend="ffi"), _params(), grads, mesh)
    assert [bool(s.stats.nonfinite) for s in states] == [False] * 3 + [True, False, False]
    for k in SHAPES:
        np.testing.assert_array_equal(late[3][k], np.zeros(SHAPES[k], np.float32))
        assert np.isfinite(late[4][k]).all() and np.isfinite(late[5][k]).all()
    assert int(states[3].count) == int(states[2].count) == 2
    np.testing.assert_array_equal(states[3].mask, states[2].mask)
    np.testing.assert_array_equal(states[1].mask, clean[1].mask)
    # Step 3's pool is its gradient alone; it keeps MU x that off the mask.
    mask = np.repeat(states[3].mask, C)[:213]
    pool3 = _pool_rows(grads[3])
    np.testing.assert_array_equal(states[3].sent.value.reshape(N, -1), pool3)
    np.testing.assert_allclose(
        states[3].residual.value.reshape(N, -1), np.where(mask, 0, MU * pool3), rtol=1e-6
    )
    assert np.isfinite(states[5].residual.value).all()


def test_sharded_model_is_refused_with_the_fix():
    mesh = mesh_of((4, 2), ("data", "fsdp"))
    params = {"w": jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P(None, "fsdp")))}
    tx = jaxcomm.chunk_sparse(
        optax.sgd(0.1), "data", density=0.5, chunk_size=4, double_buffering=True
    )
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="double_buffering=True.*fsdp"):
        tx.init(params)


def test_started_step_sends_only_between_steps(mesh, started_in_one_process):
    """The compiled started step, outside the branch that reduces a restored
    state's pool: it finishes one exchange and starts one, each of the pool
    (the start's mask says which chunks travel), and its only collective in
    the step is the norms' (one float32 per chunk). The done's result is read
    through jaxcomm_after, after the step's gradient exists."""
    run, state = update_step(_tx(True, backend="ffi"), _params(), mesh)
    rows = {
        k: jax.ShapeDtypeStruct((N, *s), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        for k, s in SHAPES.items()
    }
    program = hlo.compiled(run, state, rows)
    every_step = [(i.collective, i.elements) for i in hlo.collectives(program, branches=False)]
    assert sorted(every_step) == sorted(
        [
            ("jaxcomm_allreduce", 14),
            ("jaxcomm_allreduce_done", 213 + 1),
            ("jaxcomm_allreduce_start", 3),
        ]
    )
    fallback = [i for i in hlo.collectives(program) if (i.collective, i.elements) not in every_step]
    assert [(i.collective, i.elements) for i in fallback] == [("jaxcomm_allreduce", 213)]
    done = next(i for i in program.walk() if i.target == "jaxcomm_allreduce_done")
    every = list(program.walk())
    results = [i for i in every if done.name in i.operands]
    assert len(results) == 2  # the result and the found flag
    for result in results:
        readers = [i.target or i.opcode for i in every if result.name in i.operands]
        assert readers == ["jaxcomm_after"]
