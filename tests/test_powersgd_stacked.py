"""PowerSGD on layers stacked in one leaf (nnx.vmap, nnx.scan, nn.scan): each
layer is its own matrix, as if the layers were separate leaves.

The reference is the same transform on the layers as separate leaves (the
rule per matrix is unchanged, so the two must agree to rounding), and the
state's shapes for which matrices are compressed.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm

LAYERS, M, N = 3, 16, 24


def _run(tx, params, grads):
    """One step of `tx` in a shard_map over 8 devices, each its own gradient."""
    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")

    def step(state, g):
        updates, state = tx.update(jax.tree.map(lambda x: x[0], g), state, params)
        return updates, state

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))
    )
    return run(state, jax.device_put(grads, jax.NamedSharding(mesh, P("data"))))


def _grads(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((8, *s)).astype(np.float32) for k, s in shapes.items()}


def test_a_stacked_leaf_is_compressed_as_its_layers_would_be_apart():
    stacked = {"w": jnp.zeros((LAYERS, M, N))}
    apart = {f"w{i}": jnp.zeros((M, N)) for i in range(LAYERS)}
    g = _grads({"w": (LAYERS, M, N)})
    g_apart = {f"w{i}": g["w"][:, i] for i in range(LAYERS)}
    tx = jaxcomm.powersgd("data", rank=2, start_step=0, stacked={"w": True})
    out, state = _run(tx, stacked, g)
    want, want_state = _run(jaxcomm.powersgd("data", rank=2, start_step=0), apart, g_apart)
    for i in range(LAYERS):
        np.testing.assert_allclose(out["w"][i], want[f"w{i}"], rtol=1e-5, atol=1e-6)
    assert [q.shape for q in state.q] == [(N, 2)] * LAYERS
    stats, want_stats = jaxcomm.get_stats(state), jaxcomm.get_stats(want_state)
    # P and Q of each layer: LAYERS * 2 * (M + N) float32 elements a device.
    assert float(stats.payload_bytes) == float(want_stats.payload_bytes) == LAYERS * 2 * (M + N) * 4


def test_linen_metadata_naming_the_layer_axis_says_stacked():
    """nn.scan(metadata_params={nn.PARTITION_NAME: "layers"}) writes "layers"
    first in the kernel's names: stacked="auto" reads it at init."""
    boxed = {"w": nn.LogicallyPartitioned(jnp.zeros((LAYERS, M, N)), ("layers", "embed", "mlp"))}
    state = optax.chain(jaxcomm.powersgd("data", rank=2), optax.sgd(0.1))
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        q = state.init(boxed)[0].q
    assert [x.shape for x in q] == [(N, 2)] * LAYERS


def test_mask_auto_sees_each_layer():
    """An embedding-like table stays dense; each stacked layer, whose first
    dimension recurs, is compressed."""
    params = {"table": jnp.zeros((100, M)), "w": jnp.zeros((LAYERS, M, M))}
    tx = jaxcomm.powersgd("data", rank=2, stacked={"table": False, "w": True})
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        q = tx.init(params).q
    assert [x.shape for x in q] == [(M, 2)] * LAYERS


def test_a_stack_nothing_names_is_said_to_go_dense():
    params = {"w": jnp.zeros((LAYERS, M, N)), "v": jnp.zeros((M, N))}
    with (
        warnings.catch_warnings(record=True) as caught,
        jax.set_mesh(jax.make_mesh((8,), ("data",))),
    ):
        warnings.simplefilter("always")
        jaxcomm.powersgd("data", rank=2).init(params)
    said = [str(w.message) for w in caught if "stacked=" in str(w.message)]
    assert len(said) == 1 and "params['w']" in said[0], said


def test_bad_stacked_option_is_refused_by_name():
    with pytest.raises(ValueError, match="stacked='yes'"):
        jaxcomm.powersgd("data", stacked="yes")
    with pytest.raises(TypeError, match=r"stacked\['w'\]"):
        jaxcomm.powersgd("data", stacked={"w": 1})
