"""Data-parallel training of a small MLP classifier with jaxcomm's allreduce.

Each device holds a full copy of the parameters and a 1/N slice of every
global batch. It computes gradients on its slice, and ``jaxcomm.allreduce``
averages them over the ``"data"`` mesh axis, so every device applies the same
update and the replicas stay identical.

Import this module after ``XLA_FLAGS`` asks for several host devices (see
``main.py``); otherwise there is a single device and nothing to reduce.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

WIRE_DTYPES = {"none": None, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Config:
    """Hyperparameters and communication options of one training run.

    Attributes:
      backend: jaxcomm backend, ``"auto"``, ``"xla"`` or ``"ffi"``.
      wire_dtype: dtype gradients travel in: ``"none"`` (float32),
        ``"float16"`` or ``"bfloat16"``.
      reduce: ``"jaxcomm"`` (``jaxcomm.allreduce``) or ``"pmean"``
        (``jax.lax.pmean``, the reference).
      steps: number of optimizer steps.
      batch: global batch size; must be divisible by the device count.
      lr: SGD learning rate.
      momentum: SGD momentum.
      hidden: width of the hidden layer.
      seed: seeds the data set, the initialization and the batch order.
      log_every: print a progress line every this many steps; 0 for silence.
    """

    backend: str = "ffi"
    wire_dtype: str = "none"
    reduce: str = "jaxcomm"
    steps: int = 300
    batch: int = 512
    lr: float = 0.05
    momentum: float = 0.9
    hidden: int = 128
    seed: int = 0
    log_every: int = 50


def make_dataset(seed, num_classes=10, features=64, train=8192, test=2048, noise=2.0):
    """Synthetic classification data: Gaussian blobs around random class centres.

    Args:
      seed: seeds the centres and the samples.
      num_classes: number of classes.
      features: input dimension.
      train: number of training examples.
      test: number of test examples.
      noise: standard deviation of the per-feature noise; the centres have
        unit variance, so larger values make the classes overlap more.

    Returns:
      ``(x_train, y_train, x_test, y_test)`` as float32 / int32 numpy arrays.
    """
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_classes, features)).astype(np.float32)

    def sample(n):
        y = rng.integers(num_classes, size=n).astype(np.int32)
        x = centres[y] + noise * rng.normal(size=(n, features)).astype(np.float32)
        return x, y

    x_train, y_train = sample(train)
    x_test, y_test = sample(test)
    return x_train, y_train, x_test, y_test


def init_mlp(key, features, hidden, num_classes):
    """He-initialized 2-layer MLP parameters as a plain dict pytree."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (features, hidden)) * jnp.sqrt(2.0 / features),
        "b1": jnp.zeros((hidden,)),
        "w2": jax.random.normal(k2, (hidden, num_classes)) * jnp.sqrt(2.0 / hidden),
        "b2": jnp.zeros((num_classes,)),
    }


def apply_mlp(params, x):
    """Returns the logits of the MLP for a batch ``x``."""
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def loss_fn(params, x, y):
    """Mean softmax cross-entropy over the (local) batch."""
    logits = apply_mlp(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(config, mesh, tx):
    """Builds the jitted data-parallel training step.

    Args:
      config: the run's ``Config``.
      mesh: a 1-D mesh with axis ``"data"``.
      tx: the optax optimizer.

    Returns:
      ``step(params, opt_state, x, y) -> (params, opt_state, loss)``, taking
      replicated params / optimizer state and batch-sharded ``x``, ``y``.
    """
    wire = WIRE_DTYPES[config.wire_dtype]

    if config.reduce == "jaxcomm":

        def mean(v):
            return jaxcomm.allreduce(v, "data", op="mean", backend=config.backend, wire_dtype=wire)
    elif config.reduce == "pmean":

        def mean(v):
            return jax.lax.pmean(v, "data")
    else:
        raise ValueError(f"reduce={config.reduce!r}; expected 'jaxcomm' or 'pmean'")

    def step(params, opt_state, x, y):
        # Params arrive typed as replicated over "data". Differentiating them
        # as-is would make JAX insert its own psum of the gradients (the
        # transpose of the implicit broadcast); marking them varying keeps the
        # gradients local, so the reduction below is the only communication.
        local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
        loss, grads = jax.value_and_grad(loss_fn)(local, x, y)
        grads = jax.tree.map(mean, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, mean(loss)

    sharded = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P(), P()),
    )
    return jax.jit(sharded)


def _bytes_per_step(steps):
    """Mean bytes sent per device per step by ffi collectives since the reset."""
    stats = jaxcomm.ffi_stats()
    if not stats or steps <= 0:
        return 0.0
    return sum(s["bytes_sent"] for s in stats.values()) / len(stats) / steps


def train(config: Config) -> dict:
    """Trains the MLP on the synthetic data set, data-parallel over all devices.

    Args:
      config: the run's ``Config``.

    Returns:
      A dict with ``losses`` (per step), ``final_loss``, ``test_accuracy``,
      ``step_time_s`` (mean over the steps after the first, which compiles),
      ``backend`` (the one actually used, or ``"pmean"``),
      ``bytes_per_step`` (per device, from ``jaxcomm.ffi_stats()``; ``None``
      unless the ffi backend ran) and ``params`` (numpy copies of the final
      parameters).
    """
    n_dev = jax.device_count()
    if config.batch % n_dev:
        raise ValueError(f"batch={config.batch} is not divisible by {n_dev} devices")

    mesh = jax.make_mesh((n_dev,), ("data",))
    replicated = NamedSharding(mesh, P())
    by_batch = NamedSharding(mesh, P("data"))

    x_train, y_train, x_test, y_test = make_dataset(config.seed)
    num_classes = int(y_train.max()) + 1

    tx = optax.sgd(config.lr, momentum=config.momentum)
    params = init_mlp(jax.random.key(config.seed), x_train.shape[1], config.hidden, num_classes)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    step = make_step(config, mesh, tx)

    # jaxcomm's "auto" is xla for unmasked allreduces (see its docstring).
    backend = "pmean" if config.reduce == "pmean" else config.backend.replace("auto", "xla")

    # Batch order is seeded too, so two runs with the same config (e.g. jaxcomm
    # vs pmean) see exactly the same batches.
    rng = np.random.default_rng(config.seed + 1)
    order = np.empty(0, dtype=np.int64)
    losses, times = [], []
    for i in range(config.steps):
        if order.size < config.batch:
            order = np.concatenate([order, rng.permutation(len(x_train))])
        idx, order = order[: config.batch], order[config.batch :]
        x = jax.device_put(x_train[idx], by_batch)
        y = jax.device_put(y_train[idx], by_batch)

        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, x, y)
        # One step in flight at a time: several concurrent steps of CPU
        # collectives can abort on this machine.
        jax.block_until_ready((params, opt_state, loss))
        times.append(time.perf_counter() - start)
        if i == 0 and backend == "ffi":
            jaxcomm.reset_ffi_stats()  # count steady-state steps only

        losses.append(float(loss))
        if config.log_every and (i % config.log_every == 0 or i == config.steps - 1):
            print(f"  step {i:4d}  loss {losses[-1]:.4f}", flush=True)

    logits = jax.jit(apply_mlp)(params, x_test)
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    return {
        "losses": losses,
        "final_loss": losses[-1] if losses else float("nan"),
        "test_accuracy": accuracy,
        "step_time_s": float(np.mean(times[1:])) if len(times) > 1 else float("nan"),
        "backend": backend,
        "bytes_per_step": _bytes_per_step(config.steps - 1) if backend == "ffi" else None,
        "params": jax.tree.map(np.asarray, params),
    }
