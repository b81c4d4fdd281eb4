"""The transforms inside optax's wrappers, the way a user writes the step:
params replicated (P()), the optimizer state carried through shard_map by
jaxcomm.state_specs, gradients local to each device. Each run must equal
plain optax (or NumPy) on the float64 mean of the per-device gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.catalog import BY_NAME, ids, select
from tests.harness import mesh_of, optax_on_mean, random_grads, run_as_users_do

N = 8
SHAPES = {"w": (128,), "b": (4,)}


def _params():
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _grads(steps: int, seed: int = 0):
    return random_grads(np.random.default_rng(seed), SHAPES, N, steps)


def run_user_step(tx, params, grads_seq):
    """Runs `tx` for len(grads_seq) steps the README's way, the state built
    inside shard_map (MultiSteps' accumulator has no device axis of its own);
    returns (params, state, updates per step), params and updates as NumPy
    (the same on every device)."""
    updates, params, state = run_as_users_do(
        tx, params, grads_seq, mesh_of((N,), ("data",)), init_in_shard_map=True
    )
    return params, state, updates


def _mean(g):
    return {k: v.astype(np.float64).mean(0) for k, v in g.items()}


def _assert_close(ours, want, rtol=1e-5, atol=1e-6):
    for k in ours:
        np.testing.assert_allclose(ours[k], want[k], rtol=rtol, atol=atol, err_msg=k)


ADAMW = lambda learning_rate=1e-2: optax.adamw(learning_rate)  # noqa: E731
EXACT = select(exact=True)  # plain optax on the mean gradient, whatever the inner optimizer


@pytest.mark.parametrize("config", EXACT, ids=ids(EXACT))
def test_inject_hyperparams_after_jaxcomm(config):
    inner = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)
    grads = _grads(3)
    ours, state, _ = run_user_step(config.make("data", inner), _params(), grads)
    want, _ = optax_on_mean(
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2), _params(), grads
    )
    _assert_close(ours, want)
    assert int(jaxcomm.get_stats(state).collectives) >= 1


def test_inject_hyperparams_around_the_chain():
    def make(learning_rate):
        return optax.chain(jaxcomm.allreduce_gradients("data"), optax.adamw(learning_rate))

    grads = _grads(3)
    ours, state, _ = run_user_step(
        optax.inject_hyperparams(make)(learning_rate=1e-2), _params(), grads
    )
    want, _ = optax_on_mean(ADAMW(), _params(), grads)
    _assert_close(ours, want)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-2)


def test_masked_after_jaxcomm():
    """adamw on w only; b gets the reduced gradient as its update."""
    mask = {"w": True, "b": False}
    tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.masked(ADAMW(), mask))
    grads = _grads(3)
    ours, _, updates = run_user_step(tx, _params(), grads)
    want, _ = optax_on_mean(optax.masked(ADAMW(), mask), _params(), grads)
    _assert_close(ours, want)
    np.testing.assert_allclose(updates[-1]["b"], _mean(grads[-1])["b"], rtol=1e-5, atol=1e-6)


def test_clip_by_global_norm_after_jaxcomm_clips_the_global_gradient():
    lr, max_norm = 0.1, 0.5
    tx = optax.chain(
        jaxcomm.allreduce_gradients("data"), optax.clip_by_global_norm(max_norm), optax.sgd(lr)
    )
    grads = _grads(3)
    ours, _, _ = run_user_step(tx, _params(), grads)
    p = {k: v.astype(np.float64) for k, v in _params().items()}
    for g in grads:  # NumPy: one global norm of the averaged gradient
        mean = _mean(g)
        norm = np.sqrt(sum(np.sum(v**2) for v in mean.values()))
        scale = min(1.0, max_norm / norm)
        p = {k: p[k] - lr * scale * mean[k] for k in p}
    _assert_close(ours, p)


def test_clip_by_global_norm_before_jaxcomm_clips_each_device_alone():
    """The order the docstrings warn about: each device clips its own local
    gradient by its own norm, then the clipped gradients are averaged."""
    lr, max_norm = 0.1, 0.5
    tx = optax.chain(
        optax.clip_by_global_norm(max_norm), jaxcomm.allreduce_gradients("data"), optax.sgd(lr)
    )
    grads = _grads(1)
    ours, _, _ = run_user_step(tx, _params(), grads)
    g = {k: v.astype(np.float64) for k, v in grads[0].items()}
    norms = np.sqrt(sum(np.sum(v**2, axis=1) for v in g.values()))  # one per device
    scale = np.minimum(1.0, max_norm / norms)
    want = {k: _params()[k] - lr * (scale[:, None] * g[k]).mean(0) for k in g}
    _assert_close(ours, want)


def _with_nan(grads, step: int, device: int):
    grads = [dict(g) for g in grads]
    grads[step]["w"] = grads[step]["w"].copy()
    grads[step]["w"][device, 5] = np.nan
    return grads


def test_apply_if_finite_after_jaxcomm_skips_on_every_device():
    """A NaN on one device reaches every device through the reduction, so all
    of them skip the step together."""
    grads = _with_nan(_grads(4), step=1, device=3)
    tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.apply_if_finite(ADAMW(), 5))
    ours, state, updates = run_user_step(tx, _params(), grads)
    want, want_state = optax_on_mean(optax.apply_if_finite(ADAMW(), 5), _params(), grads)
    _assert_close(ours, want)
    assert not np.any(updates[1]["w"]) and int(state[1].total_notfinite) == 1
    assert int(want_state.total_notfinite) == 1


def test_apply_if_finite_around_jaxcomm_is_refused():
    """apply_if_finite tests each device's local gradient, so devices could
    disagree on whether to run the collective (and wait on each other for
    good); state_specs refuses it, saying where it goes."""
    tx = optax.apply_if_finite(optax.chain(jaxcomm.allreduce_gradients("data"), ADAMW()), 5)
    with pytest.raises(ValueError, match=r"apply_if_finite wraps a jaxcomm.*Put it after jaxcomm"):
        run_user_step(tx, _params(), _grads(1))


def test_multi_steps_with_state_built_like_any_transform_is_refused():
    """MultiSteps' accumulator is per device; built by tx.init under the mesh
    (the README's way) it has no device axis: jaxcomm says so and names
    jaxcomm.accumulate, rather than shard_map's shape error."""
    tx = optax.MultiSteps(optax.chain(jaxcomm.allreduce_gradients("data"), ADAMW()), 2)
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        state = tx.init(_params())
    with pytest.raises(ValueError, match=r"MultiSteps.*no row per device.*jaxcomm.accumulate"):
        jaxcomm.state_specs(state, "data")


K = 4
# The tolerance each needs: float32 rounding, or a bfloat16 wire's.
MULTI_STEP_CONFIGS = {
    "allreduce": 1e-6,
    "allreduce bf16 ef": 2e-2,
    "allreduce double buffering": 1e-6,
}


MULTI_STEP = [BY_NAME[name] for name in MULTI_STEP_CONFIGS]


@pytest.mark.parametrize("config", MULTI_STEP, ids=ids(MULTI_STEP))
def test_multi_steps_applies_the_mean_of_k_local_steps(config):
    """optax.MultiSteps around the chain: every device accumulates its own
    gradient for K micro-steps (the accumulator is per-device state) and the
    K-th step applies the mean over devices and micro-steps."""
    tol = MULTI_STEP_CONFIGS[config.name]
    lr = 1.0
    tx = optax.MultiSteps(config.make("data", optax.sgd(lr)), K)
    grads = _grads(2 * K)
    ours, _, updates = run_user_step(tx, _params(), grads)
    blocks = [
        {k: np.mean([_mean(g)[k] for g in grads[i : i + K]], 0) for k in SHAPES} for i in (0, K)
    ]
    for t, u in enumerate(updates):
        if t % K != K - 1:
            assert not any(np.any(v) for v in u.values()), f"micro-step {t} changed the params"
    applied = blocks[:1] if "double buffering" in config.name else blocks  # one emit behind
    want = {k: _params()[k] - lr * sum(b[k] for b in applied) for k in SHAPES}
    _assert_close(ours, want, rtol=tol, atol=tol)


def test_multi_steps_with_chunk_sparse():
    """density 1 is dense momentum SGD: the K-step mean, every device."""
    config = BY_NAME["chunk_sparse density 1"]
    tx = optax.MultiSteps(config.make("data"), K)
    grads = _grads(2 * K)
    ours, _, _ = run_user_step(tx, _params(), grads)
    want, _ = optax_on_mean(optax.MultiSteps(config.inner(), K), _params(), grads)
    _assert_close(ours, want)


def test_multi_steps_communicates_on_every_micro_step():
    """What MultiSteps costs (optax 0.2): it runs the inner chain on every
    micro-step and keeps the result on the K-th, so the compiled step reduces
    the accumulator each time, outside any conditional. docs/compose.md says
    how to communicate once per K steps instead."""
    tx = optax.MultiSteps(optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(1.0)), K)
    mesh = mesh_of((N,), ("data",))
    params = {"w": jnp.ones(16)}
    with jax.set_mesh(mesh):
        specs = jaxcomm.state_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def step(p, s, g):
        updates, s = tx.update({"w": g[0]}, s, p)
        return optax.apply_updates(p, updates), s

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    )
    g = jax.device_put(np.ones((N, 16), np.float32), NamedSharding(mesh, P("data")))
    hlo = run.lower(params, state, g).compile().as_text()
    reductions = [line for line in hlo.splitlines() if " all-reduce(" in line]
    assert len(reductions) == 1 and "f32[16]" in reductions[0]
    assert "conditional" not in hlo


def test_multi_steps_state_carried_as_replicated_says_to_use_state_specs():
    """Carrying the accumulator as P() types each device's own sum as the same
    everywhere; the error says which state to carry how."""
    tx = optax.MultiSteps(optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(1.0)), K)
    mesh = mesh_of((N,), ("data",))
    params = {"w": jnp.ones(16)}
    state = tx.init(params)

    def step(p, s, g):
        return tx.update({"w": g[0]}, s, p)

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )
    g = jax.device_put(np.ones((N, 16), np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="optax.MultiSteps' accumulator.*jaxcomm.state_specs"):
        run(params, state, g)


def test_accumulating_inside_the_step_communicates_once_per_k():
    """docs/compose.md's alternative to MultiSteps: K micro-batches summed
    locally by a scan, one tx.update, one collective; the params move by the
    mean over devices and micro-batches."""
    lr = 1.0
    tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(lr))
    mesh = mesh_of((N,), ("data",))
    params = _params()
    state = tx.init(params)
    grads = np.stack([g["w"] for g in _grads(K)], 1)  # (N, K, 128): device, micro-batch

    def loss(p, g):  # a linear loss whose gradient in w is g
        return jnp.vdot(p["w"], g) + 0 * jnp.sum(p["b"])

    def step(params, opt_state, micro_batches):
        local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)

        def add(acc, batch):
            return jax.tree.map(jnp.add, acc, jax.grad(loss)(local, batch)), None

        zeros = jax.tree.map(jnp.zeros_like, local)
        summed, _ = jax.lax.scan(add, zeros, micro_batches[0])
        updates, opt_state = tx.update(jax.tree.map(lambda g: g / K, summed), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )
    x = jax.device_put(grads, NamedSharding(mesh, P("data")))
    hlo = run.lower(params, state, x).compile().as_text()
    assert len([line for line in hlo.splitlines() if " all-reduce(" in line]) == 1
    new, state = jax.block_until_ready(run(params, state, x))
    # One per leaf on xla (its combiner made them the one all-reduce above), not per micro-batch.
    assert int(jaxcomm.get_stats(state).collectives) == len(SHAPES)
    want = params["w"] - lr * grads.astype(np.float64).mean((0, 1))
    np.testing.assert_allclose(new["w"], want, rtol=1e-5, atol=1e-6)
