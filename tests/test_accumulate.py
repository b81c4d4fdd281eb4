"""jaxcomm.accumulate: k micro-steps of local gradients, one reduction.

The updates against a NumPy replay (mean over devices and micro-steps on
every k-th step, zero otherwise), state built the README's way (tx.init
under jax.set_mesh, state_specs); and the compiled step: its collectives sit
inside the conditional's branch, none outside it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import hlo
from tests.harness import user_step

N = 8


def _grads(steps, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((steps, N, 3, 2)).astype(np.float32),
        "b": rng.standard_normal((steps, N, 2)).astype(np.float32),
    }


def _run(tx, k, steps, seed=0):
    mesh = jax.make_mesh((N,), ("data",))
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    grads = _grads(steps, seed)
    with jax.set_mesh(mesh):
        state = tx.init(params)
        step, _ = user_step(tx, mesh, state)
        out = []
        for t in range(steps):
            g = jax.device_put(jax.tree.map(lambda x, t=t: x[t], grads), P("data"))
            params, state, updates = step(params, state, g)
            jax.block_until_ready(params)  # one step in flight on CPU
            out.append(jax.tree.map(np.asarray, updates))
    return out, params, state, grads


@pytest.mark.parametrize("k", [1, 3])
def test_sgd_updates_against_numpy(k):
    lr, steps = 0.1, 2 * k + 1
    inner = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(lr))
    updates, params, state, grads = _run(jaxcomm.accumulate(inner, "data", every_k=k), k, steps)
    for t in range(steps):
        for name in ("w", "b"):
            if (t + 1) % k:
                want = np.zeros(grads[name].shape[2:])
            else:  # the mean over devices and the k micro-steps ending at t
                window = grads[name][t + 1 - k : t + 1].astype(np.float64)
                want = -lr * window.mean(axis=(0, 1))
            np.testing.assert_allclose(updates[t][name], want, rtol=1e-5, atol=1e-7)
    assert int(state.mini_step) == steps % k
    # What was summed since the last send is each device's own, per device.
    rest = steps % k
    np.testing.assert_allclose(
        state.gradient_sum.value["b"],
        grads["b"][steps - rest : steps].sum(0) if rest else np.zeros((N, 2)),
        rtol=1e-6,
    )


def test_adam_with_a_bfloat16_wire_matches_optax_on_the_means():
    k, steps = 2, 6
    inner = optax.chain(jaxcomm.allreduce_gradients("data", wire_dtype="bfloat16"), optax.adam(0.1))
    updates, *_, grads = _run(jaxcomm.accumulate(inner, "data", every_k=k), k, steps, seed=1)
    adam = optax.adam(0.1)
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    adam_state = adam.init(params)
    for t in range(k - 1, steps, k):
        mean = jax.tree.map(lambda g, t=t: jnp.asarray(g[t + 1 - k : t + 1].mean((0, 1))), grads)
        want, adam_state = adam.update(mean, adam_state, params)
        params = optax.apply_updates(params, want)
        for name in ("w", "b"):  # bfloat16 keeps 8 bits of the gradient
            np.testing.assert_allclose(updates[t][name], want[name], rtol=2e-2, atol=1e-3)
        np.testing.assert_array_equal(updates[t - 1]["w"], 0)  # the micro-step before


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_the_compiled_step_reduces_inside_the_kth_branch_only(backend):
    if backend == "ffi" and not jaxcomm.ffi_available():
        pytest.skip("the C++ extension is not built")
    inner = optax.chain(jaxcomm.allreduce_gradients("data", backend=backend), optax.sgd(0.1))
    tx = jaxcomm.accumulate(inner, "data", every_k=4)
    mesh = jax.make_mesh((N,), ("data",))
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    with jax.set_mesh(mesh):
        state = tx.init(params)
        g = jax.device_put(jax.tree.map(lambda x: x[0], _grads(1)), P("data"))
        program = hlo.compiled(user_step(tx, mesh, state)[0], params, state, g)
    outside = list(program.walk(branches=False))
    assert not [i.name for i in outside if i.collective]
    branches = [b for i in outside if i.opcode == "conditional" for b in i.branches]
    assert branches, "no conditional outside"
    inside = [i for b in branches for i in program.walk(b)]
    if backend == "xla":
        assert "all-reduce" in [i.opcode for i in inside]
    else:  # jaxcomm's own allreduce: a custom call, in the branch only
        assert [i for i in inside if (i.target or "").startswith("jaxcomm_allreduce")]


def test_every_k_must_be_a_positive_int():
    with pytest.raises(ValueError, match="every_k must be an int >= 1, got 0"):
        jaxcomm.accumulate(optax.sgd(0.1), "data", every_k=0)
