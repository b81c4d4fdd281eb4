"""A gradient JAX already reduced is an error, not N times the mean.

Under shard_map with replicated params, jax.grad sums the gradient over the
devices itself (the transpose of the implicit broadcast). allreduce_gradients
would then return N times the mean gradient, silently. With check_vma=True
(shard_map's default) the gradient's type says so, and the transform refuses
it, naming the leaf and the fix: every one-axis configuration of
tests/catalog.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.catalog import BY_NAME, flat, ids

N = 8


def _run(config, *, cast: bool, check_vma: bool = True):
    mesh = jax.make_mesh((N,), ("data",))
    tx = config.make("data", optax.sgd(1.0))
    params = {"layer": {"w": jnp.zeros(3)}}
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def loss(p, x):
        return jnp.sum(p["layer"]["w"] * x)

    def step(p, s, x):
        q = jax.lax.pcast(p, "data", to="varying") if cast else p
        g = jax.grad(loss)(q, x[0])
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    rows = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    x = jax.device_put(rows, NamedSharding(mesh, P("data")))
    f = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs),
        check_vma=check_vma,
    )
    new, _ = jax.jit(f)(params, state, x)
    return np.asarray(new["layer"]["w"]), rows


# With sgd(1.0), the exact configurations move the params by minus the mean gradient.
EXACT = [BY_NAME[name] for name in ("allreduce", "chunk_sparse density 1")]
FLAT = flat()


@pytest.mark.parametrize("config", EXACT, ids=ids(EXACT))
def test_varying_params_give_minus_the_mean_gradient(config):
    w, rows = _run(config, cast=True)
    np.testing.assert_allclose(w, -rows.mean(0), rtol=1e-6)


# Three elements: too few for a sparse density or a low-rank factor, as they warn.
@pytest.mark.filterwarnings("ignore:.*not reachable:UserWarning")
@pytest.mark.filterwarnings("ignore:.*no gradient leaf is compressed:UserWarning")
@pytest.mark.parametrize("config", FLAT, ids=ids(FLAT))
def test_already_reduced_gradient_names_the_leaf_and_the_fix(config):
    with pytest.raises(ValueError) as e:
        _run(config, cast=False)
    message = str(e.value)
    assert "gradient['layer']['w']" in message
    assert "already been reduced" in message
    assert "jaxcomm.value_and_grad(loss_fn, 'data') in place of jax.value_and_grad" in message


@pytest.mark.parametrize("config", EXACT, ids=ids(EXACT))
def test_without_types_the_gradient_stays_local(config):
    """check_vma=False: JAX's grad does not sum over the devices (it has no
    types to transpose), so replicated params give local gradients and the
    mean is right; nothing is checked and nothing needs to be."""
    w, rows = _run(config, cast=False, check_vma=False)
    np.testing.assert_allclose(w, -rows.mean(0), rtol=1e-6)
