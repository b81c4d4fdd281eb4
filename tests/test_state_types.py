"""A transform's state comes out of a step with the types it went in with.

jit specializes on its inputs' types: a leaf that comes back weakly typed
(``~int32``), or of another dtype or shape, makes the second step compile
the whole program again (seconds, on every run). Checked for every
configuration in tests/catalog.py, on the state that init builds, as users
carry it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.catalog import CATALOG, ids
from tests.harness import mesh_of, user_step


@pytest.mark.parametrize("config", CATALOG, ids=ids(CATALOG))
def test_state_types_survive_a_step(config):
    tx = config.make()
    mesh = mesh_of(config.mesh, config.axes)
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    with jax.set_mesh(mesh):
        state = tx.init(params)
    run, specs = user_step(tx, mesh, state, config.axis_name)
    # The catalog's fact, as state_specs reads the state.
    sharded = [s for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)) if s != P()]
    assert bool(sharded) == config.per_device_state, specs
    grads = jax.tree.map(lambda a: jnp.ones((mesh.size, *a.shape)), params)
    grads = jax.device_put(grads, NamedSharding(mesh, P(config.axes)))
    _, new, _ = jax.block_until_ready(run(params, state, grads))
    before = jax.tree_util.tree_flatten_with_path(state)[0]
    after = jax.tree.leaves(new)
    changed = [
        f"{jax.tree_util.keystr(path)}: {jax.typeof(a)} -> {jax.typeof(b)}"
        for (path, a), b in zip(before, after, strict=True)
        if jax.typeof(a) != jax.typeof(b) or getattr(a, "weak_type", False) != b.weak_type
    ]
    assert not changed, changed
