"""Data-parallel Flax (NNX) training on scikit-learn's bundled digits, with jaxcomm.

Every device holds the whole model and 1/N of each global batch. It computes
gradients on its slice; the jaxcomm transform at the head of the optax chain
turns them into the global gradient (dense, FP16 wire, double buffered,
fused, hierarchical or chunk-sparse), identical on every device.

Import this after ``XLA_FLAGS`` asks for several host devices (``main.py``
does); with one device there is nothing to communicate.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm


@dataclasses.dataclass(frozen=True)
class Comm:
    """How gradients travel in one configuration.

    Attributes:
      wire_dtype: None (float32), "float16" or "bfloat16".
      double_buffering: apply the previous step's reduced gradient.
      dga: double buffering through ``jaxcomm.double_buffered``: each
        gradient taken at this device's prediction of the params it will be
        applied to.
      bucket_bytes: fusion threshold (None: jaxcomm's default for the backend).
      hierarchical: reduce over a (node, local) = (2, N/2) mesh.
      density: chunk-sparse exchange of this fraction of chunks (None: dense).
      warmup_steps: chunk-sparse warm-up from dense to ``density``.
      chunk_size: chunk-sparse chunk, in elements.
      backend: jaxcomm backend.
    """

    wire_dtype: str | None = None
    double_buffering: bool = False
    dga: bool = False
    bucket_bytes: float | None = None
    hierarchical: bool = False
    density: float | None = None
    warmup_steps: int = 0
    chunk_size: int = 256
    backend: str = "auto"


def configurations(*, bucket_bytes: float, density: float, warmup_steps: int) -> dict:
    """The named configurations the command line can ask for."""
    return {
        "dense": Comm(),
        "fp16": Comm(wire_dtype="float16"),
        "fp16+db": Comm(wire_dtype="float16", double_buffering=True),
        "fp16+dga": Comm(wire_dtype="float16", dga=True),
        "fused": Comm(bucket_bytes=bucket_bytes, backend="ffi"),
        "hierarchical": Comm(hierarchical=True),
        "csc": Comm(density=density, warmup_steps=warmup_steps),
    }


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: a configuration, a seed and the hyperparameters."""

    comm: Comm = Comm()
    seed: int = 0
    epochs: int = 20
    batch: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    use_pmap: bool = False


class MLP(nnx.Module):
    """64 -> 256 -> 128 -> 10, ReLU."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(64, 256, rngs=rngs)
        self.hidden2 = nnx.Linear(256, 128, rngs=rngs)
        self.logits = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.hidden1(x))
        x = nnx.relu(self.hidden2(x))
        return self.logits(x)


def load_digits(seed: int, test_fraction: float = 0.2):
    """scikit-learn's 1797 8x8 digits, scaled to [0, 1], split per class
    (same split for every seed: seeds vary initialisation and batch order)."""
    from sklearn.datasets import load_digits as sk_load_digits

    del seed
    data = sk_load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    rng = np.random.default_rng(1234)
    test = np.zeros(len(y), bool)
    for label in range(10):
        idx = np.flatnonzero(y == label)
        test[rng.choice(idx, int(round(test_fraction * len(idx))), replace=False)] = True
    return x[~test], y[~test], x[test], y[test]


def make_optimizer(run: Run, axes) -> optax.GradientTransformation:
    """Momentum SGD behind the configuration's jaxcomm transform (chunk-sparse
    wraps it: GradientFlow's Algorithm 1)."""
    comm = run.comm
    if comm.density is not None:
        return jaxcomm.chunk_sparse(
            optax.sgd(run.lr, momentum=run.momentum),
            axes,
            density=comm.density,
            chunk_size=comm.chunk_size,
            warmup_steps=comm.warmup_steps,
            wire_dtype=comm.wire_dtype,
            backend=comm.backend,
        )
    options = dict(
        wire_dtype=comm.wire_dtype,
        bucket_bytes=comm.bucket_bytes,
        algorithm="hierarchical" if comm.hierarchical else "auto",
        backend=comm.backend,
    )
    sgd = optax.sgd(run.lr, momentum=run.momentum)
    if comm.dga:
        return jaxcomm.double_buffered(sgd, axes, **options)
    reduce = jaxcomm.allreduce_gradients(axes, double_buffering=comm.double_buffering, **options)
    return optax.chain(reduce, sgd)


def _loss(graphdef, params, x, y):
    model = nnx.merge(graphdef, params)
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def make_step(graphdef, tx, mesh, axes, state_specs, *, local: bool = False):
    """jit(shard_map(step)): params replicated, batch split over `axes`; with
    ``local`` (``double_buffered``) the gradient is taken at this device's
    params in the optimizer state."""

    def step(params, opt_state, x, y):
        at = jaxcomm.local_params(opt_state, like=params) if local else params
        # This device's own gradient (jax.grad of replicated params would sum
        # it over the devices), so the jaxcomm transform does the only
        # communication.
        loss, grads = jaxcomm.local_value_and_grad(_loss, axes, argnums=1)(graphdef, at, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jax.lax.pmean(loss, axes)

    data = P(axes)
    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), state_specs, data, data),
            out_specs=(P(), state_specs, P()),
        )
    )


def make_pmap_step(graphdef, tx, *, local: bool = False):
    def step(params, opt_state, x, y):
        at = jaxcomm.local_params(opt_state, like=params) if local else params
        loss, grads = jax.value_and_grad(_loss, argnums=1)(graphdef, at, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    return jax.pmap(step, axis_name="data")


def train(run: Run, *, progress=None) -> dict:
    """Trains the MLP data-parallel over all devices.

    Args:
      run: what to train and how gradients travel.
      progress: optional callable taking (step, total, loss), e.g. a tqdm update.

    Returns:
      ``losses`` (per step), ``test_accuracy``, ``step_time_s`` (mean over
      the steps after the first, which compiles), ``bytes_per_step`` (bytes
      this device sends per step, from ``jaxcomm.get_stats``, mean over
      steps) and ``params`` (NumPy copies of the final parameters).
    """
    n = jax.device_count()
    if run.batch % n:
        raise ValueError(f"batch={run.batch} is not divisible by {n} devices")
    if run.comm.hierarchical and (run.use_pmap or n % 2):
        raise ValueError("hierarchical needs shard_map (not pmap) and an even device count")
    x_train, y_train, x_test, y_test = load_digits(run.seed)
    graphdef, params = nnx.split(MLP(nnx.Rngs(run.seed)), nnx.Param)

    if run.comm.hierarchical:
        mesh = jax.make_mesh((2, n // 2), ("node", "local"))
        axes = ("node", "local")
    else:
        mesh = jax.make_mesh((n,), ("data",))
        axes = "data"
    tx = make_optimizer(run, axes)

    if run.use_pmap:
        replicate = lambda t: jax.tree.map(lambda v: np.broadcast_to(v, (n, *v.shape)), t)  # noqa: E731
        params = replicate(jax.tree.map(np.asarray, params))
        opt_state = jax.pmap(tx.init, axis_name="data")(params)
        step = make_pmap_step(graphdef, tx, local=run.comm.dga)

        def put(v):
            return v.reshape(n, -1, *v.shape[1:])
    else:
        with jax.set_mesh(mesh):
            opt_state = tx.init(params)
        specs = jaxcomm.state_specs(opt_state, axes)
        opt_state = jax.device_put(opt_state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        step = make_step(graphdef, tx, mesh, axes, specs, local=run.comm.dga)
        batch_sharding = NamedSharding(mesh, P(axes))

        def put(v):
            return jax.device_put(v, batch_sharding)

    rng = np.random.default_rng(run.seed + 1)
    steps_per_epoch = len(x_train) // run.batch
    total = run.epochs * steps_per_epoch
    losses, times, sent = [], [], []
    for epoch in range(run.epochs):
        order = rng.permutation(len(x_train))
        for b in range(steps_per_epoch):
            idx = order[b * run.batch : (b + 1) * run.batch]
            x, y = put(x_train[idx]), put(y_train[idx])
            start = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, x, y)
            # One step in flight: several concurrent steps of XLA CPU
            # collectives can abort (see README).
            jax.block_until_ready((params, opt_state, loss))
            times.append(time.perf_counter() - start)
            stats = jaxcomm.get_stats(opt_state)
            sent.append(float(np.asarray(stats.bytes_sent).reshape(-1)[0]))
            losses.append(float(np.asarray(loss).reshape(-1)[0]))
            if progress is not None:
                progress(epoch * steps_per_epoch + b + 1, total, losses[-1])

    params = jax.tree.map(lambda v: np.asarray(v[0] if run.use_pmap else v), params)
    logits = nnx.merge(graphdef, params)(jnp.asarray(x_test))  # on one device
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    return {
        "losses": losses,
        "test_accuracy": accuracy,
        "step_time_s": float(np.mean(times[1:])) if len(times) > 1 else math.nan,
        "bytes_per_step": float(np.mean(sent)),
        "params": jax.tree.map(np.asarray, nnx.to_pure_dict(params)),
    }
