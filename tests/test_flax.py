"""The transforms inside Flax's own training containers: nnx.Optimizer under
jit + shard_map, and a Linen TrainState under pmap and under shard_map, with
the state carried by jaxcomm.state_specs, for every one-axis configuration in
tests/catalog.py. Each run must equal the same transform driven as plain
optax on pure pytrees (or under pmap), and exact configurations must also
equal the same container driven by lax.pmean gradients and plain optax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.catalog import BY_NAME, flat, ids

# Three steps: past PowerSGD's start (2) and one past DiLoCo's sync (every 2).
STEPS, N, BATCH = 3, 8, 32
FLAT = flat()  # the configurations on one mesh axis
LINEN = [c for c in FLAT if not c.gradient_at_local_params]


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS, BATCH, 12)).astype(np.float32)
    y = rng.integers(0, 5, (STEPS, BATCH)).astype(np.int32)
    return x, y


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(12, 16, rngs=rngs)
        self.b = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


def _local_grads(model, x, y):
    """This device's gradient of the model's params (typed as varying, so JAX
    does not sum it over the devices)."""
    mdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logits = nnx.merge(mdef, p, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
    return jax.grad(loss)(local)


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(5)(linen.relu(linen.Dense(16)(x)))


def _linen_run(tx, reduce: str):
    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 12)))["params"]

    def step(state, x, y):
        def loss(p):
            logits = state.apply_fn({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss)(state.params)
        if reduce == "pmean":
            grads = jax.lax.pmean(grads, "data")
        return state.apply_gradients(grads=grads)

    run = jax.pmap(step, axis_name="data")
    create = lambda p: train_state.TrainState.create(apply_fn=model.apply, params=p, tx=tx)  # noqa: E731
    state = jax.pmap(create, axis_name="data")(
        jax.tree.map(lambda v: np.broadcast_to(v, (N, *v.shape)), params)
    )
    xs, ys = _data()
    for x, y in zip(xs, ys, strict=True):
        state = jax.block_until_ready(run(state, x.reshape(N, -1, 12), y.reshape(N, -1)))
    return jax.tree.map(np.asarray, state.params)


def _put(tree, specs, mesh):
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def _batches(mesh):
    batch = NamedSharding(mesh, P("data"))
    return [
        (jax.device_put(x, batch), jax.device_put(y, batch)) for x, y in zip(*_data(), strict=True)
    ]


def _nnx_container_run(tx, grads=lambda model, optimizer, x, y: _local_grads(model, x, y)):
    """An nnx.Optimizer with `tx` under jit + shard_map, the state carried by
    state_specs; `grads` gives this device's gradient. Returns the params,
    the stats, the specs and the optimizer after the last step."""
    mesh = jax.make_mesh((N,), ("data",))
    model = NnxMLP(nnx.Rngs(0))
    with jax.set_mesh(mesh):
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    specs = jaxcomm.state_specs(state, "data")

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, grads(model, optimizer, x, y))
        return nnx.state((model, optimizer))

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=specs)
    )
    state = _put(state, specs, mesh)
    for x, y in _batches(mesh):
        state = jax.block_until_ready(run(state, x, y))
    model, optimizer = nnx.merge(graphdef, state)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    stats = jaxcomm.get_stats(nnx.state(optimizer))
    # The optimizer's own opt_state holds nnx variables; get_stats unwraps them too.
    for a, b in zip(jaxcomm.get_stats(optimizer.opt_state), stats, strict=True):
        assert isinstance(a, jax.Array) and np.array_equal(a, b)
    return jax.tree.map(np.asarray, params), stats, specs, optimizer


def _nnx_functional_run(tx, reduce: str, *, at_local: bool = False):
    """The same model and data as pure pytrees through plain optax; the
    gradient taken at diloco's local params with `at_local`."""
    mesh = jax.make_mesh((N,), ("data",))
    mdef, param_state, rest = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.to_pure_dict(param_state)
    with jax.set_mesh(mesh):
        opt_state = tx.init(params)
    specs = jaxcomm.state_specs(opt_state, "data")

    def step(params, opt_state, x, y):
        def loss(p):
            state = jax.tree.map(lambda v: v, param_state)
            nnx.replace_by_pure_dict(state, p)
            logits = nnx.merge(mdef, state, rest)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        if at_local:
            local = jaxcomm.local_params(opt_state)
        else:
            local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
        grads = jax.grad(loss)(local)
        if reduce == "pmean":
            grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    run = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs),
        )
    )
    opt_state = _put(opt_state, specs, mesh)
    for x, y in _batches(mesh):
        params, opt_state = jax.block_until_ready(run(params, opt_state, x, y))
    return jax.tree.map(np.asarray, params)


def _grads_at_local(model, optimizer, x, y):
    """This device's gradient at its own params, read with
    local_params(..., like=params) (diloco, double_buffered)."""
    mdef, params, rest = nnx.split(model, nnx.Param, ...)
    here = jaxcomm.local_params(optimizer.opt_state, like=params)

    def loss(p):
        logits = nnx.merge(mdef, p, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jax.grad(loss)(here)


# Each run once per module: the parametrized tests and the ones that look
# closer at one configuration share them.
@functools.cache
def _nnx_container(name: str):
    config = BY_NAME[name]
    if config.gradient_at_local_params:
        return _nnx_container_run(config.make(), _grads_at_local)
    return _nnx_container_run(config.make())


@functools.cache
def _nnx_functional(name: str):
    config = BY_NAME[name]
    return _nnx_functional_run(config.make(), "", at_local=config.gradient_at_local_params)


@functools.cache
def _nnx_pmean(inner):
    """Plain optax `inner()` on lax.pmean gradients: what exact configurations equal."""
    return _nnx_functional_run(inner(), "pmean")


@functools.cache
def _linen_pmean(inner):
    return _linen_run(inner(), "pmean")


@pytest.mark.parametrize("config", FLAT, ids=ids(FLAT))
def test_nnx_optimizer_with_every_option_in_shard_map(config):
    ours, stats, _, _ = _nnx_container(config.name)
    want = _nnx_functional(config.name)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    if config.exact:
        exact = _nnx_pmean(config.inner)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(exact), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if config.gradient_at_local_params:
        # The outer (diloco) or the overlapped (double_buffered) step moved every leaf.
        init = nnx.to_pure_dict(nnx.state(NnxMLP(nnx.Rngs(0)), nnx.Param))
        for a, c in zip(jax.tree.leaves(ours), jax.tree.leaves(init), strict=True):
            assert np.abs(a - np.asarray(c)).max() > 1e-3
    # Read through nnx.state(optimizer): plain arrays, what the last step sent
    # (DiLoCo's last step, one past its sync, sent nothing).
    assert isinstance(stats.collectives, jax.Array)
    if config.name.startswith("diloco"):
        assert int(stats.collectives) == 0
    else:
        assert int(stats.collectives) >= 1 and float(stats.payload_bytes) > 0
    if config.name.startswith("chunk_sparse") and not config.exact:
        assert float(stats.density) < 1


AT_LOCAL = [c for c in FLAT if c.gradient_at_local_params]


@pytest.mark.parametrize("config", AT_LOCAL, ids=ids(AT_LOCAL))
def test_data_parallel_takes_the_gradient_at_each_devices_params(config):
    """A jit-style step under data_parallel, jaxcomm.value_and_grad at the
    model as every jit program writes it: the gradient is taken at
    local_params (what diloco and double_buffered require), so the run equals
    the plain-optax run that takes it there by hand."""
    mesh = jax.make_mesh((N,), ("data",))
    model = NnxMLP(nnx.Rngs(0))
    with jax.set_mesh(mesh):
        optimizer = nnx.Optimizer(model, config.make(), wrt=nnx.Param)

    @jaxcomm.data_parallel
    def step(model, optimizer, x, y):
        def loss(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jaxcomm.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    with jax.set_mesh(mesh):
        for x, y in _batches(mesh):
            jax.block_until_ready(step(model, optimizer, x, y))
    ours = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    want = _nnx_functional(config.name)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _linen_shard_map_run(tx):
    mesh = jax.make_mesh((N,), ("data",))
    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 12)))["params"]
    with jax.set_mesh(mesh):
        state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    specs = jaxcomm.state_specs(state, "data")

    def step(state, x, y):
        def loss(p):
            logits = state.apply_fn({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), state.params)
        return state.apply_gradients(grads=jax.grad(loss)(local))

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=specs)
    )
    state = _put(state, specs, mesh)
    for x, y in _batches(mesh):
        state = jax.block_until_ready(run(state, x, y))
    return jax.tree.map(np.asarray, state.params), jaxcomm.get_stats(state)


@pytest.mark.parametrize("config", LINEN, ids=ids(LINEN))
def test_linen_train_state_with_every_option_in_shard_map(config):
    ours, stats = _linen_shard_map_run(config.make())
    # The same transform under pmap, where every state leaf is per device;
    # the params come out the same on every device.
    want = _linen_run(config.make(), "")
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b[0], rtol=1e-5, atol=1e-6)
        assert all(np.array_equal(b[0], b[d]) for d in range(N))
    if config.exact:
        exact = _linen_pmean(config.inner)
        for a, b, c in zip(*(jax.tree.leaves(t) for t in (ours, want, exact)), strict=True):
            np.testing.assert_allclose(a, c[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)
    assert int(stats.collectives) >= 1


# DiLoCo and double_buffered under nnx.Optimizer: the model holds the global
# (synced) params, replicated; the state holds each device's own params and
# DiLoCo's inner state or double_buffered's previous gradient, as PerDevice
# rows that state_specs must find by name in NNX state.
def _check_rows_per_device(specs, fields):
    """The state's leaves under `fields` (by name) are one row per device,
    P("data"); every other leaf is P()."""
    row_specs = {
        jax.tree_util.keystr(path): spec
        for path, spec in jax.tree_util.tree_leaves_with_path(
            specs, is_leaf=lambda s: isinstance(s, P)
        )
    }
    rows = [k for k in row_specs if any(f"'{f}'" in k for f in fields)]
    assert rows and all(row_specs[k] == P("data") for k in rows)
    assert all(v == P() for k, v in row_specs.items() if k not in rows)


def test_nnx_optimizer_with_diloco_keeps_each_devices_params():
    _, _, specs, optimizer = _nnx_container("diloco")
    _check_rows_per_device(specs, ("local", "inner"))
    # A step past the last sync, every device's own params differ.
    rows = jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(optimizer)["opt_state"]["local"]))
    assert all(r.shape[0] == N and np.abs(r - r[:1]).max() > 0 for r in rows)


def test_nnx_optimizer_with_double_buffered_keeps_each_devices_params():
    _, _, specs, _ = _nnx_container("double_buffered bf16")
    _check_rows_per_device(specs, ("local", "buffer"))


def test_local_params_like_names_a_mismatched_leaf():
    tx = BY_NAME["diloco"].make()
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        state = tx.init({"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)})
    row = state  # one device: one row, as inside shard_map
    with pytest.raises(ValueError, match=r"like\['w'\] has shape \(3, 2\)"):
        jaxcomm.local_params(row, like={"w": jnp.zeros((3, 2)), "b": jnp.zeros(3)})
    with pytest.raises(ValueError, match="like has 1 leaves but the diloco state holds 2"):
        jaxcomm.local_params(row, like={"w": jnp.zeros((2, 3))})
