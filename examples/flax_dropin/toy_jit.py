"""Flax's data-parallel NNX toy (an MLP fit to a parabola) as its docs write it
(replicated state, the batch split over "data", ``nnx.jit``): ``toy_jit.py``,
where XLA reduces the gradients, and ``toy_jaxcomm.py``, where jaxcomm does
(the diff is in docs/dropin.md)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

mesh = jax.sharding.Mesh(jax.devices(), ("data",))
model_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
data_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


class MLP(nnx.Module):
    def __init__(self, din, dmid, dout, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def main(steps=300, seed=0):
    model = MLP(1, 64, 1, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    state = nnx.state((model, optimizer))  # replicate state
    state = jax.device_put(state, model_sharding)
    nnx.update((model, optimizer), state)

    @nnx.jit
    def train_step(model: MLP, optimizer: nnx.Optimizer, x, y):
        def loss_fn(model: MLP):
            y_pred = model(x)
            return jnp.mean((y - y_pred) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        x = rng.uniform(-2, 2, size=(16, 1)).astype(np.float32)
        y = 0.8 * x**2 + 0.1 + rng.normal(0, 0.1, size=x.shape).astype(np.float32)
        x, y = jax.device_put((x, y), data_sharding)  # shard data
        losses.append(float(train_step(model, optimizer, x, y)))
    return {"losses": losses, "model": model}


if __name__ == "__main__":
    losses = main()["losses"]
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
