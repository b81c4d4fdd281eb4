"""jaxcomm.local_grad: each device's own gradient of replicated params.

The reference is NumPy: the gradient of a linear loss on one device's rows
is those rows, hand-computed, never the sum over devices that jax.grad of
replicated params gives under shard_map.
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


def _loss(p, x):
    return jnp.sum(p["w"] * x) + 0.5 * jnp.sum(p["b"] ** 2)


def _rows():
    return np.arange(N * 3, dtype=np.float32).reshape(N, 3)


def _placed(x, mesh):
    """x's leading axes split over all of `mesh`, as shard_map's in_specs say."""
    return jax.device_put(x, NamedSharding(mesh, P(*mesh.axis_names)))


def test_each_device_gets_its_own_gradient():
    mesh = jax.make_mesh((N,), ("data",))
    params = {"w": jnp.ones(3), "b": jnp.full(2, 2.0)}

    def body(p, x):
        g = jaxcomm.local_grad(_loss, "data")(p, x[0])
        return jax.tree.map(lambda a: a[None], g)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    g = jax.jit(f)(params, _placed(_rows(), mesh))
    np.testing.assert_array_equal(np.asarray(g["w"]), _rows())  # d/dw sum(w*x) = x
    np.testing.assert_array_equal(np.asarray(g["b"]), np.full((N, 2), 2.0))


def test_value_and_grad_with_aux_and_argnums():
    mesh = jax.make_mesh((N,), ("data",))

    def loss(scale, p, x):
        return scale * jnp.sum(p["w"] * x), jnp.sum(x)

    def body(scale, p, x):
        (value, aux), g = jaxcomm.local_value_and_grad(loss, "data", argnums=1, has_aux=True)(
            scale, p, x[0]
        )
        return value[None], aux[None], g["w"][None]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P("data"),) * 3)
    value, aux, gw = jax.jit(f)(jnp.float32(2.0), {"w": jnp.ones(3)}, _placed(_rows(), mesh))
    x = _rows().astype(np.float64)
    np.testing.assert_allclose(np.asarray(value), 2 * x.sum(1))
    np.testing.assert_allclose(np.asarray(aux), x.sum(1))
    np.testing.assert_allclose(np.asarray(gw), 2 * x)


def test_step_with_local_grad_gives_the_mean_not_n_times_it():
    """The README's step: with local_grad, one SGD step moves by the mean
    gradient; plain jax.grad is refused by the transform (it would be N x)."""
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(1.0))
    params = {"w": jnp.zeros(3), "b": jnp.zeros(2)}
    state = tx.init(params)

    def step(grad_fn):
        def body(p, s, x):
            u, s = tx.update(grad_fn(_loss)(p, x[0]), s, p)
            return optax.apply_updates(p, u), s

        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
        )

    new, _ = step(lambda f: jaxcomm.local_grad(f, "data"))(params, state, _placed(_rows(), mesh))
    np.testing.assert_allclose(np.asarray(new["w"]), -_rows().astype(np.float64).mean(0))
    with pytest.raises(ValueError, match=r"gradient\['b'\].*already"):
        step(jax.grad)(params, state, _placed(_rows(), mesh))


def test_already_varying_params_and_two_axes():
    mesh = jax.make_mesh((2, 4), ("node", "gpu"))

    def body(p, x):
        p = jax.lax.pcast(p, "gpu", to="varying")  # varying over one axis already
        g = jaxcomm.local_grad(_loss, ("node", "gpu"))(p, x[0, 0])
        return g["w"][None, None]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("node", "gpu")), out_specs=P("node", "gpu"))
    g = jax.jit(f)({"w": jnp.ones(3), "b": jnp.zeros(2)}, _placed(_rows().reshape(2, 4, 3), mesh))
    np.testing.assert_array_equal(np.asarray(g).reshape(N, 3), _rows())


def test_under_pmap():
    def body(p, x):
        return jaxcomm.local_grad(_loss, "i")(p, x)["w"]

    p = {"w": jnp.ones((N, 3)), "b": jnp.zeros((N, 2))}
    g = jax.pmap(body, axis_name="i")(p, _rows())
    np.testing.assert_array_equal(np.asarray(g), _rows())


def test_outside_shard_map_names_the_axis():
    with pytest.raises(ValueError, match=r"axis_name='data' is not bound here, and no axis is"):
        jaxcomm.local_grad(_loss, "data")({"w": jnp.ones(3), "b": jnp.zeros(2)}, jnp.ones(3))


def _nnx_model():
    nnx = pytest.importorskip("flax.nnx")

    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 2, rngs=rngs)
            self.norm = nnx.BatchNorm(2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.norm(self.linear(x)))

    return nnx, Tiny(nnx.Rngs(0))


def _in_shard_map(fn, *args):
    mesh = jax.make_mesh((N,), ("data",))
    f = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return jax.jit(f)(*args)


NNX_REFUSED = (
    r"is a Flax NNX Tiny; jax.grad of an NNX object loses its state updates \(BatchNorm's "
    r"running statistics, Dropout's RNG state\)\. Use jaxcomm.value_and_grad\(loss_fn, "
    r"axis_name\)\(model, \.\.\.\) or jaxcomm.grad"
)


@pytest.mark.parametrize(
    "make,name",
    [(jaxcomm.local_grad, "local_grad"), (jaxcomm.local_value_and_grad, "local_value_and_grad")],
)
def test_an_nnx_module_is_refused_with_what_to_use_instead(make, name):
    """BatchNorm's running statistics would be dropped and Dropout's RNG would
    fail inside the trace: both are refused before jax.grad runs."""
    nnx, model = _nnx_model()
    x = jnp.ones((4, 3))

    def loss(m, x):
        return jnp.sum(m(x))

    with pytest.raises(ValueError, match=rf"^{name}: argument 0 \(argnums\) {NNX_REFUSED}"):
        make(loss, "data")(model, x)
    # Nested in the differentiated argument, the message gives the path.
    with pytest.raises(ValueError, match=rf"^{name}: argument 1\['model'\] \(argnums\) "):
        make(lambda s, t: loss(t["model"], x) * s, "data", argnums=(0, 1))(1.0, {"model": model})


def test_the_param_state_of_an_nnx_module_is_taken():
    """The way the error points to: nnx.split, differentiate the Param state.
    Reference: the hand-computed gradient of sum(x @ W + b) on one device's x."""
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)

    def loss(p, x):
        return jnp.sum(nnx.merge(graphdef, p, rest)(x))

    g = _in_shard_map(lambda p, x: jaxcomm.local_grad(loss, "data")(p, x), params, x)
    np.testing.assert_allclose(np.asarray(g["kernel"][...]), np.repeat(x.sum(0)[:, None], 2, 1))
    np.testing.assert_allclose(np.asarray(g["bias"][...]), np.full(2, 4.0))
