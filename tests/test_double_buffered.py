"""double_buffered against NumPy float64 references, step by step.

Each of the 8 devices fits a linear regression to its own targets, so the
devices' gradients differ. Three references, each independent of the code:

- plain SGD: delayed gradient averaging as its paper writes the update of
  each device's own weights (``w_i <- w_i - lr g_i + lr (g_i' - mean g')``,
  primes for the previous step);
- any optimizer: the docstring's two-line recurrence, with optax's SGD
  momentum and Adam rewritten in float64;
- the synchronous run: where every device sees the same inputs (so the
  gradient is linear in the params with one Hessian) and the optimizer is
  linear (momentum SGD), the synced params after step t+1 are exactly those
  of synchronous data-parallel training after step t.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import reference as reference_opt
from tests.harness import mesh_of, regression_data

N = 8
SHAPES = {"b": (), "w": (6,)}
NAMES = list(SHAPES)
FEATURES, BATCH, STEPS = 6, 5, 8
LR, MOMENTUM = 0.05, 0.9


def _data(*, shared_inputs: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    return regression_data(rng, STEPS, N, BATCH, FEATURES, shared_inputs=shared_inputs)


def _params():
    rng = np.random.default_rng(3)
    return {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _loss(p, x, y):
    return 0.5 * jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _np_grad(p, x, y):
    r = x @ p["w"] + p["b"] - y
    return {"b": r.mean(), "w": x.T @ r / len(y)}


def _add(a, b, scale=1.0):
    return {k: a[k] + scale * b[k] for k in a}


def _mean(trees):
    return {k: np.mean([t[k] for t in trees], axis=0) for k in trees[0]}


OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(LR), lambda: reference_opt.Sgd(LR)),
    "momentum": (
        lambda: optax.sgd(LR, momentum=MOMENTUM),
        lambda: reference_opt.Sgd(LR, momentum=MOMENTUM),
    ),
    "adam": (lambda: optax.adam(LR), lambda: reference_opt.Adam(LR)),
}


def reference(opt, x, y, *, at_local: bool = True):
    """The docstring's recurrence in float64: per step (synced params, every
    device's local params). ``at_local=False`` takes the gradients at the
    synced params instead: plain double buffering
    (``allreduce_gradients(double_buffering=True)`` before ``opt``)."""
    params = {k: v.astype(np.float64) for k, v in _params().items()}
    state = opt.init(SHAPES)
    local = [dict(params) for _ in range(N)]
    previous = None
    out = []
    for s in range(STEPS):
        grads = [_np_grad(local[d] if at_local else params, x[s, d], y[s, d]) for d in range(N)]
        if previous is not None:
            u, state = opt.update(_mean(previous), state)
            params = _add(params, u)
        local = [_add(params, opt.update(g, state)[0]) for g in grads]
        previous = grads
        out.append((params, local))
    return out


def dga_sgd(x, y):
    """Delayed gradient averaging with a delay of one, plain SGD, as Zhu et
    al. (2021) write it per device: per step, every device's weights."""
    w = [{k: v.astype(np.float64) for k, v in _params().items()} for _ in range(N)]
    previous = None
    out = []
    for s in range(STEPS):
        grads = [_np_grad(w[d], x[s, d], y[s, d]) for d in range(N)]
        for d in range(N):
            w[d] = _add(w[d], grads[d], -LR)
            if previous is not None:
                correction = _add(previous[d], _mean(previous), -1.0)
                w[d] = _add(w[d], correction, LR)
        previous = grads
        out.append([dict(p) for p in w])
    return out


def synchronous(opt, x, y):
    """Data-parallel training on the mean gradient: params after each step."""
    params = {k: v.astype(np.float64) for k, v in _params().items()}
    state = opt.init(SHAPES)
    out = []
    for s in range(STEPS):
        g = _mean([_np_grad(params, x[s, d], y[s, d]) for d in range(N)])
        u, state = opt.update(g, state)
        params = _add(params, u)
        out.append(params)
    return out


# -- running the transform ---------------------------------------------------


def run(tx, x, y):
    """The docstring's step under jit + shard_map, one step in flight: per
    step (params, every device's local params, stats), as NumPy."""
    mesh = mesh_of((N,), ("data",))
    with jax.set_mesh(mesh):
        state = tx.init(_params())
    specs = jaxcomm.state_specs(state, "data")

    def step(params, state, x, y):
        grads = jax.grad(_loss)(jaxcomm.local_params(state), x[0], y[0])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rows = P("data")
    jitted = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, rows, rows), out_specs=(P(), specs))
    )
    put = lambda t, s: jax.device_put(t, NamedSharding(mesh, s))  # noqa: E731
    state = jax.tree.map(put, state, specs)
    params = put(_params(), P())
    out = []
    for s in range(STEPS):
        params, state = jax.block_until_ready(
            jitted(params, state, put(x[s], rows), put(y[s], rows))
        )
        local = jax.tree.map(np.asarray, state.local.value)
        out.append(
            (
                jax.tree.map(np.asarray, params),
                [{k: local[k][d] for k in NAMES} for d in range(N)],
                jaxcomm.get_stats(state),
            )
        )
    return out, specs


def _close(got, want, tol=2e-5):
    for k in NAMES:
        np.testing.assert_allclose(got[k], want[k], rtol=tol, atol=tol, err_msg=k)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_matches_the_recurrence_every_step(name):
    make, np_opt = OPTIMIZERS[name]
    x, y = _data()
    got, _ = run(jaxcomm.double_buffered(make(), "data"), x, y)
    want = reference(np_opt(), x.astype(np.float64), y.astype(np.float64))
    for s, ((params, local, _), (want_params, want_local)) in enumerate(
        zip(got, want, strict=True)
    ):
        _close(params, want_params)
        for d in range(N):
            _close(local[d], want_local[d])
        if s == 0:  # nothing to apply yet
            _close(params, _params(), tol=0)
    # The devices' gradients differ, so their local params do.
    assert np.abs(got[-1][1][0]["w"] - got[-1][1][1]["w"]).max() > 1e-3


def test_with_sgd_it_is_delayed_gradient_averaging():
    x, y = _data(seed=1)
    got, _ = run(jaxcomm.double_buffered(optax.sgd(LR), "data"), x, y)
    want = dga_sgd(x.astype(np.float64), y.astype(np.float64))
    for (_, local, _), weights in zip(got, want, strict=True):
        for d in range(N):
            _close(local[d], weights[d])


def test_linear_problem_and_optimizer_follow_synchronous_training_one_step_behind():
    x, y = _data(shared_inputs=True, seed=2)
    make, np_opt = OPTIMIZERS["momentum"]
    got, _ = run(jaxcomm.double_buffered(make(), "data"), x, y)
    want = synchronous(np_opt(), x.astype(np.float64), y.astype(np.float64))
    for s in range(1, STEPS):
        _close(got[s][0], want[s - 1])
    # Plain double buffering on the same problem does not: its gradient is stale.
    stale = reference(np_opt(), x.astype(np.float64), y.astype(np.float64), at_local=False)
    assert np.abs(stale[-1][0]["w"] - want[-2]["w"]).max() > 1e-3


def test_state_specs_stats_and_wire():
    x, y = _data()
    tx = jaxcomm.double_buffered(optax.adam(LR), "data", wire_dtype=jnp.float16)
    got, specs = run(tx, x, y)
    assert specs.local.value == {"b": P("data"), "w": P("data")}
    assert specs.reduce.buffer.value == {"b": P("data"), "w": P("data")}
    assert all(s == P() for s in jax.tree.leaves(specs.inner, is_leaf=lambda s: isinstance(s, P)))
    stats = got[-1][2]
    assert float(stats.payload_bytes) == 2 * 7  # 7 elements in float16
    assert int(stats.collectives) >= 1


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="inner="):
        jaxcomm.double_buffered(lambda g: g, "data")
    with pytest.raises(TypeError, match="wire_dtype=.float24. is not a dtype"):
        jaxcomm.double_buffered(optax.sgd(0.1), "data", wire_dtype="float24")
    mesh = mesh_of((N,), ("data",))
    tx = jaxcomm.double_buffered(optax.sgd(0.1), "data")
    with jax.set_mesh(mesh):
        state = tx.init(_params())
    with pytest.raises(ValueError, match="needs params"):
        tx.update(_params(), state)
    # Outside shard_map the state holds every device's row.
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jaxcomm.local_params(state)
    with pytest.raises(ValueError, match="one diloco or double_buffered state"):
        jaxcomm.local_params((state, state))
    with jax.set_mesh(mesh_of((1,), ("data",))):
        row = tx.init(_params())  # one device: one row, as inside shard_map
    with pytest.raises(ValueError, match="like has 1 leaves but the double_buffered state holds 2"):
        jaxcomm.local_params(row, like={"w": jnp.zeros(6)})


def test_the_docs_snippet_runs_and_takes_two_adam_steps():
    """docs/double_buffering.md's code as written. By hand: step 0 applies
    nothing, steps 1 and 2 one AdamW step each on gradients of the same sign
    everywhere (every device's x is 1 and w stays far below it), and AdamW's
    first steps move each coordinate by its learning rate: w = 2 x 3e-3."""
    doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "double_buffering.md"
    (code,) = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    scope: dict = {}
    exec(compile(code, str(doc), "exec"), scope)
    np.testing.assert_allclose(np.asarray(scope["params"]["w"]), 2 * 3e-3, rtol=1e-3)
