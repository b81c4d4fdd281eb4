"""A gradient JAX already reduced is an error, not N times the mean.

Under shard_map with replicated params, jax.grad sums the gradient over the
devices itself (the transpose of the implicit broadcast). allreduce_gradients
would then return N times the mean gradient, silently. With check_vma=True
(shard_map's default) the gradient's type says so, and the transform refuses
it, naming the leaf and the fix.
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

N = 8


def _run(*, cast: bool, check_vma: bool = True):
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(1.0))
    params = {"layer": {"w": jnp.zeros(3)}}
    state = tx.init(params)

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
        step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()), check_vma=check_vma
    )
    new, _ = jax.jit(f)(params, state, x)
    return np.asarray(new["layer"]["w"]), rows


def test_varying_params_give_minus_the_mean_gradient():
    w, rows = _run(cast=True)
    np.testing.assert_allclose(w, -rows.mean(0), rtol=1e-6)


def test_already_reduced_gradient_names_the_leaf_and_the_fix():
    with pytest.raises(ValueError) as e:
        _run(cast=False)
    message = str(e.value)
    assert "gradient['layer']['w']" in message
    assert "already been reduced" in message
    assert "jax.lax.pcast(params, 'data', to=\"varying\")" in message


def test_without_types_the_gradient_stays_local():
    """check_vma=False: JAX's grad does not sum over the devices (it has no
    types to transpose), so replicated params give local gradients and the
    mean is right; nothing is checked and nothing needs to be."""
    w, rows = _run(cast=False, check_vma=False)
    np.testing.assert_allclose(w, -rows.mean(0), rtol=1e-6)
