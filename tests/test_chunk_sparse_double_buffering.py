"""chunk_sparse(double_buffering=True) on 8 CPU devices: chunk_sparse run one
step late, bitwise, whether its exchange runs in the step or travels between
steps (started at a step's end, finished in the next)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import hlo
from tests.harness import mesh_of, random_grads

N = 8
SHAPES = {"a": (70,), "b": (13, 11)}  # pool = [b, a], 213 elements
C = 16  # 14 chunks, the last one of 5 elements
DECAY = 0.9


@pytest.fixture
def mesh():
    return mesh_of((N,), ("data",))


def _params():
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _pool_rows(tree) -> np.ndarray:
    """Leaves in reverse tree order (the pool's order), one row per device."""
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.reshape(x, (x.shape[0], -1)) for x in reversed(leaves)], axis=1)


def _run(tx, grads, mesh, *, forge_at=None):
    """`tx`'s update on each step's `grads` (one row per device) as users run
    it: the state placed by state_specs, one step in flight. Returns the
    updates, the states (NumPy) and, after each step, how many more
    allreduces are in flight than before. At step `forge_at` the handle is
    made another job's (a state restored by a new process)."""
    from jaxcomm import _ffi

    with jax.set_mesh(mesh):
        state = tx.init(_params())
    specs = jaxcomm.state_specs(state, "data")

    def step(state, g):
        return tx.update(jax.tree.map(lambda x: x[0], g), state)

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))
    )
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    updates, states, in_flight, before = [], [], [], _ffi.in_flight()
    for t, g in enumerate(grads):
        if t == forge_at:
            state = state._replace(handle=np.asarray(state.handle) + np.int32([1, 0, 0]))
        u, state = jax.block_until_ready(
            run(state, jax.device_put(g, NamedSharding(mesh, P("data"))))
        )
        updates.append(jax.tree.map(np.asarray, u))
        states.append(jax.tree.map(np.asarray, state))
        in_flight.append(_ffi.in_flight() - before)
    return updates, states, in_flight


def _tx(double_buffering, **options):
    return jaxcomm.chunk_sparse(
        optax.sgd(0.05, momentum=0.9),
        "data",
        density=0.3,
        chunk_size=C,
        residual_decay=DECAY,
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
    now, now_states, _ = _run(_tx(False, **options), grads, mesh)
    late, late_states, in_flight = _run(_tx(True, **options), grads, mesh)
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
    now, now_states, _ = _run(_tx(False, backend="ffi", wire_dtype=wire), grads, mesh)
    for forge_at in (None, 2):
        late, late_states, in_flight = _run(
            _tx(True, backend="ffi", wire_dtype=wire), grads, mesh, forge_at=forge_at
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
    _, clean, _ = _run(_tx(True, backend="ffi"), grads[:2], mesh)
    late, states, _ = _run(_tx(True, backend="ffi"), grads, mesh)
    assert [bool(s.stats.nonfinite) for s in states] == [False] * 3 + [True, False, False]
    for k in SHAPES:
        np.testing.assert_array_equal(late[3][k], np.zeros(SHAPES[k], np.float32))
        assert np.isfinite(late[4][k]).all() and np.isfinite(late[5][k]).all()
    assert int(states[3].count) == int(states[2].count) == 2
    np.testing.assert_array_equal(states[3].mask, states[2].mask)
    np.testing.assert_array_equal(states[1].mask, clean[1].mask)
    # Step 3's pool is its gradient alone; it keeps DECAY x that off the mask.
    mask = np.repeat(states[3].mask, C)[:213]
    pool3 = _pool_rows(grads[3])
    np.testing.assert_array_equal(states[3].sent.value.reshape(N, -1), pool3)
    np.testing.assert_allclose(
        states[3].residual.value.reshape(N, -1), np.where(mask, 0, DECAY * pool3), rtol=1e-6
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
    tx = _tx(True, backend="ffi")
    with jax.set_mesh(mesh):
        state = tx.init(_params())
    specs = jaxcomm.state_specs(state, "data")

    def step(state, g):
        return tx.update(jax.tree.map(lambda x: x[0], g), state)

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))
    )
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
