"""A Linen ``TrainState`` program, data parallel as Flax's guides write it
(state replicated, the batch split over "data", ``jax.jit``), a classifier
of scikit-learn's digits: ``linen_jit.py``, where XLA reduces the
gradients, and ``linen_jaxcomm.py``, where jaxcomm does (the diff is in
docs/dropin.md)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits

import jaxcomm

mesh = jax.sharding.Mesh(jax.devices(), ("data",))
replicated = jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
data_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


@jaxcomm.data_parallel
def train_step(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jaxcomm.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def main(steps=100, batch_size=64, seed=0):
    digits = load_digits()
    x_all = (digits.data / 16).astype(np.float32)
    y_all = digits.target.astype(np.int32)
    model = MLP()
    params = model.init(jax.random.key(seed), x_all[:1])["params"]
    tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(0.1, momentum=0.9))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = jax.device_put(state, replicated)

    order = np.random.default_rng(seed).permutation(len(x_all))
    losses = []
    for step in range(steps):
        rows = order[(step * batch_size) % 1728 :][:batch_size]
        x, y = jax.device_put((x_all[rows], y_all[rows]), data_sharding)
        state, loss = train_step(state, x, y)
        losses.append(float(loss))
    return {"losses": losses, "state": state}


if __name__ == "__main__":
    losses = main()["losses"]
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
