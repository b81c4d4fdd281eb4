"""An NNX MLP as Flax's sharding guide writes it: params annotated with
``nnx.with_partitioning``, a constraint naming the data axis on the hidden
activations, created under an Auto ("data", "model") mesh."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.jit_programs import leaf_placements

AXES = ("data", "model")


def mesh(model: int = 4):
    return jax.make_mesh((2, model), AXES, axis_types=(AxisType.Auto,) * 2)


class MLP(nnx.Module):
    def __init__(self, rngs, dropout=0.0):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(nnx.with_partitioning(init, (None, "model"))(rngs.params(), (16, 64)))
        self.b1 = nnx.Param(jnp.zeros((64,)))
        self.w2 = nnx.Param(nnx.with_partitioning(init, ("model", None))(rngs.params(), (64, 4)))
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        h = self.drop(jax.nn.relu(x @ self.w1 + self.b1))
        h = jax.lax.with_sharding_constraint(h, P("data", "model"))
        return h @ self.w2


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def build(tx, on, dropout=0.0):
    with jax.set_mesh(on):
        model = MLP(nnx.Rngs(0), dropout)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def jit_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


@jaxcomm.data_parallel
def jaxcomm_step(model, optimizer, x, y):
    loss, grads = jaxcomm.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def batches(on, n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((32, 16)).astype(np.float32)
        out.append(jax.device_put((x, np.tanh(x[:, :4])), NamedSharding(on, P("data"))))
    return out


def run(form, objects, data, on):
    """The losses of `form` ("jit" or "jaxcomm") over `data`, one step in flight."""
    step = jit_step if form == "jit" else jaxcomm_step
    with jax.set_mesh(on):
        return [float(jax.block_until_ready(step(*objects, *batch))) for batch in data]


def placements(objects, params_only=False):
    """(shape, spec) of every param, then of every optimizer leaf."""
    model, optimizer = objects
    tree = nnx.state(model) if params_only else (nnx.state(model), nnx.state(optimizer))
    return leaf_placements(tree)
