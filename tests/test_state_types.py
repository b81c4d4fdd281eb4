"""A transform's state comes out of a step with the types it went in with.

jit specializes on its inputs' types: a leaf that comes back weakly typed
(``~int32``), or of another dtype or shape, makes the second step compile
the whole program again (seconds, on every run). Checked for every
transform, on the state that init builds, as users carry it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

N = 8


def _transforms():
    sgd = optax.sgd(0.1, momentum=0.9)
    return {
        "allreduce": optax.chain(jaxcomm.allreduce_gradients("data"), sgd),
        "allreduce fp16 ef db": optax.chain(
            jaxcomm.allreduce_gradients(
                "data", wire_dtype="float16", error_feedback=True, double_buffering=True
            ),
            sgd,
        ),
        "fp8": optax.chain(jaxcomm.allreduce_gradients("data", wire_dtype="float8_e4m3fn"), sgd),
        "chunk_sparse": jaxcomm.chunk_sparse(sgd, "data", density=0.5, chunk_size=64),
        "powersgd": optax.chain(jaxcomm.powersgd("data", rank=2), sgd),
        "powersgd start 2": optax.chain(jaxcomm.powersgd("data", rank=2, start_step=2), sgd),
        "diloco": jaxcomm.diloco(optax.adam(1e-3), sgd, "data", sync_every=2),
        "double_buffered": jaxcomm.double_buffered(
            optax.adamw(1e-3), "data", wire_dtype=jnp.bfloat16
        ),
    }


@pytest.mark.parametrize("name", list(_transforms()))
def test_state_types_survive_a_step(name):
    tx = _transforms()[name]
    mesh = jax.make_mesh((N,), ("data",))
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda a: a[0], g), s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    )
    grads = jax.tree.map(lambda a: jnp.ones((N, *a.shape)), params)
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    _, new = jax.block_until_ready(run(params, state, grads))
    before = jax.tree_util.tree_flatten_with_path(state)[0]
    after = jax.tree.leaves(new)
    changed = [
        f"{jax.tree_util.keystr(path)}: {jax.typeof(a)} -> {jax.typeof(b)}"
        for (path, a), b in zip(before, after, strict=True)
        if jax.typeof(a) != jax.typeof(b) or getattr(a, "weak_type", False) != b.weak_type
    ]
    assert not changed, changed
