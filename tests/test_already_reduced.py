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


def _dense():
    return optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(1.0))


def _sparse():
    return jaxcomm.chunk_sparse(optax.sgd(1.0), "data", density=1.0, chunk_size=2)


def _run(*, cast: bool, check_vma: bool = True, make_tx=_dense):
    mesh = jax.make_mesh((N,), ("data",))
    tx = make_tx()
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


TRANSFORMS = pytest.mark.parametrize("make_tx", [_dense, _sparse], ids=["dense", "chunk_sparse"])


@TRANSFORMS
def test_varying_params_give_minus_the_mean_gradient(make_tx):
    w, rows = _run(cast=True, make_tx=make_tx)
    np.testing.assert_allclose(w, -rows.mean(0), rtol=1e-6)


@TRANSFORMS
def test_already_reduced_gradient_names_the_leaf_and_the_fix(make_tx):
    with pytest.raises(ValueError) as e:
        _run(cast=False, make_tx=make_tx)
    message = str(e.value)
    assert "gradient['layer']['w']" in message
    assert "already been reduced" in message
    assert "jaxcomm.value_and_grad(loss_fn, 'data') in place of jax.value_and_grad" in message


@TRANSFORMS
def test_without_types_the_gradient_stays_local(make_tx):
    """check_vma=False: JAX's grad does not sum over the devices (it has no
    types to transpose), so replicated params give local gradients and the
    mean is right; nothing is checked and nothing needs to be."""
    w, rows = _run(cast=False, check_vma=False, make_tx=make_tx)
    np.testing.assert_allclose(w, -rows.mean(0), rtol=1e-6)
