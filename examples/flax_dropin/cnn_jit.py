"""Flax's NNX MNIST tutorial (a CNN with BatchNorm and Dropout, an
``nnx.MultiMetric``), made data parallel as Flax's data-parallel toy is
(replicated state, the batch split over "data", ``nnx.jit``), on
scikit-learn's 8x8 digits: ``cnn_jit.py``, where XLA reduces the gradients,
and ``cnn_jaxcomm.py``, where jaxcomm does (the diff is in docs/dropin.md)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from functools import partial

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

mesh = jax.sharding.Mesh(jax.devices(), ("data",))
model_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
data_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, dropout: float, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(16, rngs=rngs)
        self.dropout1 = nnx.Dropout(dropout, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(32, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(32 * 4 * 4, 64, rngs=rngs)
        self.dropout2 = nnx.Dropout(dropout, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        x = self.dropout1(nnx.relu(self.batch_norm1(self.conv1(x))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = self.dropout2(nnx.relu(self.linear1(x)))
        return self.linear2(x)


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


def main(steps=60, batch_size=64, dropout=0.1, seed=0):
    model = CNN(dropout=dropout, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(),
        loss=nnx.metrics.Average("loss"),
    )
    state = nnx.state((model, optimizer, metrics))  # replicate state
    nnx.update((model, optimizer, metrics), jax.device_put(state, model_sharding))

    @nnx.jit
    def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
        """Train for a single step."""
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
        optimizer.update(model, grads)  # In-place updates.

    @nnx.jit
    def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
        loss, logits = loss_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.

    digits = load_digits()
    images = (digits.images[..., None] / 16).astype(np.float32)
    labels = digits.target.astype(np.int32)
    train = {"image": images[:1536], "label": labels[:1536]}
    test = {"image": images[1536:1792], "label": labels[1536:1792]}
    order = np.random.default_rng(seed).permutation(1536)

    history = []
    model.train()
    for step in range(steps):
        rows = order[(step * batch_size) % 1536 :][:batch_size]
        batch = jax.device_put({k: v[rows] for k, v in train.items()}, data_sharding)
        train_step(model, optimizer, metrics, batch)
        jax.block_until_ready(model)
        history.append(metrics.compute())
    train_metrics = metrics.compute()
    metrics.reset()
    model.eval()
    eval_step(model, metrics, jax.device_put(test, data_sharding))
    return {"history": history, "train": train_metrics, "test": metrics.compute(), "model": model}


if __name__ == "__main__":
    result = main()
    print("train", {k: float(v) for k, v in result["train"].items()})
    print("test", {k: float(v) for k, v in result["test"].items()})
