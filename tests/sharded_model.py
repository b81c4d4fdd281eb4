"""A small model sharded over a fast mesh axis ("fsdp") and replicated over
the data axis: hybrid sharded data parallelism, written the way a user of
``jax.shard_map`` writes it. jaxcomm reduces over "data" only; the user's own
forward pass gathers the params over "fsdp" (autodiff reduce-scatters their
gradients back). The reference is plain optax on the exact global gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

SPECS = {"w1": P("fsdp", None), "w2": P(None, "fsdp"), "b": P()}
BATCH = 16
ROWS = P(("data", "fsdp"))  # the batch, split over every device


def init_params(seed: int = 0, hidden: int = 8) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w1": (0.3 * rng.standard_normal((16, hidden))).astype(np.float32),
        "w2": (0.3 * rng.standard_normal((hidden, 4))).astype(np.float32),
        "b": np.zeros(4, np.float32),
    }


def batches(steps: int, seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((BATCH, 16)).astype(np.float32)
        out.append((x, np.tanh(x[:, :4] + 0.5 * x[:, 4:8])))
    return out


def predict(full, x):
    return jnp.tanh(x @ full["w1"]) @ full["w2"] + full["b"]


def global_loss(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def _gather(p):
    """The full params from this device's shards (the user's FSDP forward)."""
    return {
        "w1": jax.lax.all_gather(p["w1"], "fsdp", axis=0, tiled=True),
        "w2": jax.lax.all_gather(p["w2"], "fsdp", axis=1, tiled=True),
        "b": p["b"],
    }


def shard_loss(params, x, y):
    """This device's rows' loss, its share of the mean over "fsdp": the
    gradients autodiff reduce-scatters over "fsdp" then sum to the mean."""
    return global_loss(_gather(params), x, y) / jax.lax.axis_size("fsdp")


def mesh(data: int, fsdp: int):
    return jax.make_mesh((data, fsdp), ("data", "fsdp"), devices=jax.devices()[: data * fsdp])


def place(params: dict, m, specs=None) -> dict:
    specs = SPECS if specs is None else specs
    return {k: jax.device_put(v, NamedSharding(m, specs[k])) for k, v in params.items()}


def _at(params, opt_state, local: bool):
    """Where the gradient is taken: the params, or with `local` this
    device's own in the state (diloco, double_buffered)."""
    return jaxcomm.local_params(opt_state, like=params) if local else params


def train_step(tx, m, state_specs, *, local: bool = False):
    """The jitted shard_map step over both axes: each device holds its
    shards and its own rows of the batch (split over both axes, as FSDP
    splits it), takes its own gradient over "data" (jaxcomm.local_grad) and
    hands it to `tx`."""

    def step(params, opt_state, x, y):
        at = _at(params, opt_state, local)
        grads = jaxcomm.local_grad(shard_loss, "data")(at, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(
        jax.shard_map(
            step,
            mesh=m,
            in_specs=(SPECS, state_specs, ROWS, ROWS),
            out_specs=(SPECS, state_specs),
        )
    )


def run(tx, m, steps: int, seed: int = 0, *, start=None, skip: int = 0, local: bool = False):
    """(params after `steps` steps, final state, the batches), one step in
    flight. `start`: (params, state) to go on from, after `skip` steps;
    `local`: the gradient taken at jaxcomm.local_params."""
    data = batches(steps)
    with jax.set_mesh(m):
        params = place(init_params(seed), m)
        opt_state = tx.init(params)
        if start is not None:
            params, opt_state = start
        specs = jaxcomm.state_specs(opt_state, "data")
        step = train_step(tx, m, specs, local=local)
        for x, y in data[skip:]:
            x, y = jax.device_put((x, y), NamedSharding(m, ROWS))
            params, opt_state = jax.block_until_ready(step(params, opt_state, x, y))
    return params, opt_state, data


def reference(tx, data, seed: int = 0, *, delay: int = 0):
    """Plain optax on the global gradient, in float64. `delay`: the gradient
    applied at step t is step t - delay's (zeros before), double buffering's."""
    params = jax.tree.map(lambda v: v.astype(np.float64), init_params(seed))
    with jax.enable_x64():
        state = tx.init(params)
        grads = [jax.tree.map(np.zeros_like, params)] * delay
        for x, y in data:
            grads.append(jax.grad(global_loss)(params, x.astype(np.float64), y.astype(np.float64)))
            updates, state = tx.update(grads.pop(0), state, params)
            params = jax.tree.map(np.asarray, optax.apply_updates(params, updates))
    return params


def run_replicated(tx, data: int, steps: int, seed: int = 0, *, local: bool = False):
    """The same training with the params whole on every device of a
    ("data",) mesh of `data` devices: each device's gradient is of the rows
    its data row of the sharded mesh holds, so a transform on the sharded
    model should match this run."""
    m = jax.make_mesh((data,), ("data",), devices=jax.devices()[:data])

    def step(params, opt_state, x, y):
        grads = jaxcomm.local_grad(global_loss, "data")(_at(params, opt_state, local), x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.set_mesh(m):
        params = jax.device_put(init_params(seed), NamedSharding(m, P()))
        opt_state = tx.init(params)
        specs = jaxcomm.state_specs(opt_state, "data")
        run = jax.jit(
            jax.shard_map(
                step,
                mesh=m,
                in_specs=(P(), specs, P("data"), P("data")),
                out_specs=(P(), specs),
            )
        )
        for x, y in batches(steps):
            x, y = jax.device_put((x, y), NamedSharding(m, P("data")))
            params, opt_state = jax.block_until_ready(run(params, opt_state, x, y))
    return params


def explicit_mesh(data: int, fsdp: int):
    """The mesh of jit's sharding-in-types: XLA shards over "fsdp"."""
    explicit = jax.sharding.AxisType.Explicit
    return jax.make_mesh(
        (data, fsdp),
        ("data", "fsdp"),
        axis_types=(explicit, explicit),
        devices=jax.devices()[: data * fsdp],
    )


def run_explicit(tx, m, steps: int, seed: int = 0):
    """The other style: jit over an Explicit mesh, a shard_map manual over
    "data" only, XLA sharding the params over "fsdp" by their types; the
    loss is the plain one on the data row's batch."""
    whole = {k: P() for k in SPECS}

    def step(params, opt_state, x, y):
        grads = jaxcomm.local_grad(global_loss, "data")(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    data = batches(steps)
    with jax.set_mesh(m):
        params = place(init_params(seed), m)
        opt_state = tx.init(params)
        specs = jaxcomm.state_specs(opt_state, "data", axis_names={"data"})
        run = jax.jit(
            jax.shard_map(
                step,
                in_specs=(whole, specs, P("data"), P("data")),
                out_specs=(whole, specs),
                axis_names={"data"},
            )
        )
        for x, y in data:
            x, y = jax.device_put((x, y), NamedSharding(m, P("data")))
            params, opt_state = jax.block_until_ready(run(params, opt_state, x, y))
    return params, opt_state, data
