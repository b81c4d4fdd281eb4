"""Data-parallel training of the byte transformer with jaxcomm, and its validation loss.

Every device holds the whole model and 1/N of each global batch of windows.
It computes gradients on its slice; the jaxcomm transform at the head of the
optax chain (or ``chunk_sparse`` around AdamW) turns them into the global
gradient, identical on every device.

With ``fsdp`` > 1 the model is sharded instead (docs/sharded.md): the devices
form a (data, fsdp) mesh, each matrix is split over "fsdp", each step gathers
the params over "fsdp" for the forward pass (autodiff reduce-scatters the
gradients), and jaxcomm reduces over "data" only, its state sharded like
the params.

Import this after ``XLA_FLAGS`` asks for several host devices (``main.py``
does); with one device there is nothing to communicate.
"""

from __future__ import annotations

import dataclasses
import math
import time

import data
import delay
import jax
import model
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

AXIS = "data"
FSDP = "fsdp"


@dataclasses.dataclass(frozen=True)
class Comm:
    """How gradients travel in one configuration.

    Attributes:
      wire_dtype: None (float32), "float16", "bfloat16" or "float8_e4m3fn".
      error_feedback: keep what the wire cast dropped for the next step.
      double_buffering: apply the previous step's reduced gradient.
      dga: double buffering through ``jaxcomm.double_buffered``, each
        gradient taken at this device's prediction of the params it will be
        applied to (with ``wire_dtype`` and ``error_feedback``).
      delay_compensation: λ of the DC-ASGD correction of a double-buffered
        gradient (None: none); see delay.py.
      weight_prediction: take the gradient at ``2 w_t - w_{t-1}``, the
        linear prediction of the parameters it will be applied to one step
        later under double buffering.
      density: chunk-sparse exchange of this fraction of chunks (None: dense).
      chunk_size: chunk-sparse chunk, in elements.
      warmup_steps: chunk-sparse warm-up from dense to ``density``.
      residual_decay: chunk-sparse factor on the unsent gradient (momentum
        correction; 0 drops what was not sent).
      powersgd: PowerSGD before AdamW, with ``jaxcomm.powersgd``'s defaults
        but for ``powersgd_rank``.
      powersgd_rank: PowerSGD's rank (None: its default, from each matrix's shape).
      sync_every: DiLoCo with AdamW inside, synchronising every this many
        steps through the outer optimizer ``OUTER_SGD`` (None: not DiLoCo).
      delay: DiLoCo's outer update lands this many steps after its sync
        (Streaming DiLoCo's tau).
      mixing: at a landing each device keeps this share of its own params
        (Streaming DiLoCo's alpha).
      sparse_density: SparseLoCo's outer step (``OUTER_SPARSE``) in place of
        ``OUTER_SGD``, sending this fraction of each chunk (None: dense).
      outer_lr: DiLoCo's outer learning rate (None: ``OUTER_SGD``'s).
      outer_momentum: DiLoCo's outer Nesterov momentum, 0 for none (None:
        ``OUTER_SGD``'s); 1.0 and 0 make the outer step plain averaging.
    """

    wire_dtype: str | None = None
    error_feedback: bool = False
    double_buffering: bool = False
    dga: bool = False
    delay_compensation: float | None = None
    weight_prediction: bool = False
    density: float | None = None
    chunk_size: int = 1024
    warmup_steps: int = 30
    residual_decay: float = 0.9
    powersgd: bool = False
    powersgd_rank: int | None = None
    sync_every: int | None = None
    delay: int = 0
    mixing: float = 0.0
    sparse_density: float | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None


# DiLoCo's outer step, as in the DiLoCo paper: Nesterov momentum on the
# averaged change of the devices' models.
OUTER_SGD = dict(learning_rate=0.7, momentum=0.9, nesterov=True)
# SparseLoCo's, as in its paper: an error buffer decayed by 0.95 in place of
# the momentum, top-k of chunks of 4096, 2-bit values, outer learning rate 1.
OUTER_SPARSE = dict(learning_rate=1.0, error_decay=0.95, chunk_size=4096, value_bits=2)

CONFIGURATIONS = {
    "dense": Comm(),
    "bf16": Comm(wire_dtype="bfloat16"),
    "fp16": Comm(wire_dtype="float16"),
    "fp16+ef": Comm(wire_dtype="float16", error_feedback=True),
    "int8+ef": Comm(wire_dtype="int8", error_feedback=True),
    "int4+ef": Comm(wire_dtype="int4", error_feedback=True),
    "db": Comm(double_buffering=True),
    "fp16+db": Comm(wire_dtype="float16", double_buffering=True),
    "db+dc": Comm(double_buffering=True, delay_compensation=1.0),
    "db+wp": Comm(double_buffering=True, weight_prediction=True),
    # Double buffering as jaxcomm recommends it around AdamW (docs/double_buffering.md).
    "dga": Comm(dga=True),
    "fp16+dga": Comm(wire_dtype="float16", dga=True),
    "csc": Comm(density=0.15),
    # The same bytes or fewer spent on more chunks: what keeps AdamW within
    # 2% of dense (docs/lm.md).
    "csc+fp8": Comm(density=0.6, wire_dtype="float8_e4m3fn"),
    "powersgd": Comm(powersgd=True),
    "diloco": Comm(sync_every=50),
    "diloco+delay": Comm(sync_every=50, delay=5, mixing=0.5),
    "sparseloco": Comm(sync_every=50, sparse_density=0.02),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: a configuration, a seed and the hyperparameters."""

    comm: Comm = Comm()
    seed: int = 0
    steps: int = 300
    batch_per_device: int = 8
    lr: float = 3e-3
    b1: float = 0.9
    lr_warmup: int = 0
    eval_every: int = 50
    eval_windows: int = 256
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64
    train_bytes: int = data.TRAIN_BYTES
    val_bytes: int = data.VAL_BYTES
    fsdp: int = 1


def learning_rate(run: Run):
    """Constant, after an optional linear warm-up from 0 over ``lr_warmup`` steps."""
    if not run.lr_warmup:
        return run.lr
    return optax.linear_schedule(0.0, run.lr, run.lr_warmup)


def outer_sgd(comm: Comm) -> optax.GradientTransformation:
    """DiLoCo's outer SGD: ``OUTER_SGD`` with the configuration's overrides."""
    lr = OUTER_SGD["learning_rate"] if comm.outer_lr is None else comm.outer_lr
    momentum = OUTER_SGD["momentum"] if comm.outer_momentum is None else comm.outer_momentum
    if momentum == 0:
        return optax.sgd(lr)
    return optax.sgd(lr, momentum=momentum, nesterov=True)


def make_optimizer(run: Run) -> optax.GradientTransformation:
    """AdamW behind the configuration's jaxcomm transform (chunk-sparse and
    DiLoCo wrap it)."""
    comm = run.comm
    adamw = optax.adamw(learning_rate(run), b1=run.b1)
    if comm.sync_every is not None:
        if comm.sparse_density is None:
            outer = outer_sgd(comm)
        else:
            outer = jaxcomm.sparse_outer(density=comm.sparse_density, **OUTER_SPARSE)
        return jaxcomm.diloco(
            adamw,
            outer,
            AXIS,
            sync_every=comm.sync_every,
            delay=comm.delay,
            mixing=comm.mixing,
            wire_dtype=comm.wire_dtype,
        )
    if comm.dga:
        return jaxcomm.double_buffered(
            adamw, AXIS, wire_dtype=comm.wire_dtype, error_feedback=comm.error_feedback
        )
    if comm.powersgd:
        rank = {} if comm.powersgd_rank is None else {"rank": comm.powersgd_rank}
        powersgd = jaxcomm.powersgd(AXIS, wire_dtype=comm.wire_dtype, **rank)
        return optax.chain(powersgd, adamw)
    if comm.density is not None:
        return jaxcomm.chunk_sparse(
            adamw,
            AXIS,
            density=comm.density,
            chunk_size=comm.chunk_size,
            warmup_steps=comm.warmup_steps,
            residual_decay=comm.residual_decay,
            wire_dtype=comm.wire_dtype,
        )
    reduce = jaxcomm.allreduce_gradients(
        AXIS,
        wire_dtype=comm.wire_dtype,
        error_feedback=comm.error_feedback,
        double_buffering=comm.double_buffering,
    )
    if comm.delay_compensation is None:
        return optax.chain(reduce, adamw)
    return optax.chain(reduce, delay.delay_compensation(comm.delay_compensation), adamw)


def _loss(graphdef, params, windows):
    logits = nnx.merge(graphdef, params)(windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def param_specs(params, fsdp: int):
    """Each matrix split over "fsdp" along its first dimension that `fsdp`
    divides; vectors, and everything with ``fsdp=1``, whole."""

    def spec(x):
        if fsdp > 1 and x.ndim >= 2:
            for d, n in enumerate(x.shape):
                if n % fsdp == 0:
                    return P(*[None] * d, FSDP)
        return P()

    return jax.tree.map(spec, params)


def _gathered(params, specs):
    """The whole params from this device's shards (the FSDP forward)."""

    def whole(x, spec):
        for d, axis in enumerate(spec):
            if axis is not None:
                return jax.lax.all_gather(x, axis, axis=d, tiled=True)
        return x

    return jax.tree.map(whole, params, specs)


def _shard_loss(graphdef, params, windows, specs, fsdp: int):
    """This device's share of the loss: autodiff's reduce-scatter over
    "fsdp" sums the shards' gradients, so each divides its mean by fsdp."""
    return _loss(graphdef, _gathered(params, specs), windows) / fsdp


def _mesh(fsdp: int):
    n = jax.device_count()
    if fsdp == 1:
        return jax.make_mesh((n,), (AXIS,))
    return jax.make_mesh((n // fsdp, fsdp), (AXIS, FSDP))


def _rows(fsdp: int):
    """The windows' spec: over every device."""
    return P(AXIS) if fsdp == 1 else P((AXIS, FSDP))


def make_step(
    graphdef,
    tx,
    mesh,
    state_specs,
    *,
    weight_prediction: bool = False,
    specs=None,
    local: bool = False,
):
    """jit(shard_map(step)): params replicated (or sharded as `specs` says,
    over "fsdp"), windows split over the devices.

    The step takes and returns the previous parameters too (unused unless
    ``weight_prediction``). With ``local`` (DiLoCo, ``double_buffered``) the
    gradient is taken at this device's own params, which live in the
    optimizer state.
    """
    fsdp = dict(mesh.shape).get(FSDP, 1)
    specs = P() if specs is None else specs

    def step(params, previous, opt_state, windows):
        at = params
        if weight_prediction:
            # A double-buffered gradient is applied one step later, to
            # w_{t+1} ≈ w_t + (w_t - w_{t-1}): take it there.
            at = jax.tree.map(lambda w, w_prev: 2 * w - w_prev, params, previous)
        if local:
            at = jaxcomm.local_params(opt_state, like=params)
        # This device's own gradient (jax.grad of replicated params would sum
        # it over the devices), so the jaxcomm transform does the only
        # communication.
        if fsdp == 1:
            loss_fn, args = _loss, (graphdef, at, windows)
        else:
            loss_fn, args = _shard_loss, (graphdef, at, windows, specs, fsdp)
        loss, grads = jaxcomm.local_value_and_grad(loss_fn, AXIS, argnums=1)(*args)
        updates, opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if fsdp > 1:
            loss = jax.lax.psum(loss, FSDP)
        return new_params, params, opt_state, jax.lax.pmean(loss, AXIS)

    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(specs, specs, state_specs, _rows(fsdp)),
            out_specs=(specs, specs, state_specs, P()),
        )
    )


def make_eval(graphdef, mesh, specs=None):
    """Mean next-byte loss (nats) over windows split across the devices."""
    fsdp = dict(mesh.shape).get(FSDP, 1)
    specs = P() if specs is None else specs
    axes = AXIS if fsdp == 1 else (AXIS, FSDP)

    def evaluate(params, windows):
        whole = params if fsdp == 1 else _gathered(params, specs)
        return jax.lax.pmean(_loss(graphdef, whole, windows), axes)

    return jax.jit(jax.shard_map(evaluate, mesh=mesh, in_specs=(specs, _rows(fsdp)), out_specs=P()))


def train(run: Run, *, progress=None, corpus: data.Corpus | None = None) -> dict:
    """Trains the byte transformer data-parallel over all devices.

    Args:
      run: what to train and how gradients travel.
      progress: optional callable taking (step, total, loss), e.g. a tqdm update.
      corpus: the bytes to train and validate on (default: ``data.load_corpus``
        with the run's sizes).

    Returns:
      ``losses`` (training loss per step), ``val_steps`` and ``val_losses``
      (validation loss before training, every ``eval_every`` steps and at
      the end), ``val_loss`` (the last), ``step_time_s`` (mean over the steps
      after the first, which compiles), ``wall_s``, ``bytes_per_step``
      (bytes this device sends per step, from ``jaxcomm.get_stats``, mean
      over steps) and ``params`` (the parameter count).
    """
    start_wall = time.perf_counter()
    n = jax.device_count()
    if corpus is None:
        corpus = data.load_corpus(train_bytes=run.train_bytes, val_bytes=run.val_bytes)
    if run.eval_windows % n:
        raise ValueError(f"eval_windows={run.eval_windows} is not divisible by {n} devices")
    if run.fsdp < 1 or n % run.fsdp:
        raise ValueError(f"fsdp={run.fsdp} must be a positive divisor of the {n} devices")
    net = model.ByteTransformer(
        layers=run.layers,
        width=run.width,
        heads=run.heads,
        context=run.context,
        rngs=nnx.Rngs(run.seed),
    )
    graphdef, params = nnx.split(net, nnx.Param)
    mesh = _mesh(run.fsdp)
    pspecs = param_specs(params, run.fsdp)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), pspecs))
    tx = make_optimizer(run)
    with jax.set_mesh(mesh):  # the state is placed like the params, rows per data device
        opt_state = tx.init(params)
    specs = jaxcomm.state_specs(opt_state, AXIS)
    opt_state = jax.device_put(opt_state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    step = make_step(
        graphdef,
        tx,
        mesh,
        specs,
        weight_prediction=run.comm.weight_prediction,
        specs=pspecs,
        local=run.comm.sync_every is not None or run.comm.dga,
    )
    previous = params
    evaluate = make_eval(graphdef, mesh, pspecs)
    split = NamedSharding(mesh, _rows(run.fsdp))
    # One window more than the context: inputs are [:-1], targets [1:].
    val_windows = jax.device_put(
        data.fixed_windows(corpus.val, run.eval_windows, run.context + 1), split
    )

    def validate():
        return float(jax.block_until_ready(evaluate(params, val_windows)))

    rng = np.random.default_rng(run.seed + 1)
    val_steps, val_losses = [0], [validate()]
    losses, times, sent = [], [], []
    for t in range(1, run.steps + 1):
        windows = data.sample_windows(corpus.train, run.batch_per_device * n, run.context + 1, rng)
        windows = jax.device_put(windows, split)
        start = time.perf_counter()
        params, previous, opt_state, loss = step(params, previous, opt_state, windows)
        # One step in flight: several concurrent steps of XLA CPU
        # collectives can abort (see the repository README).
        jax.block_until_ready((params, previous, opt_state, loss))
        times.append(time.perf_counter() - start)
        sent.append(float(np.asarray(jaxcomm.get_stats(opt_state).bytes_sent).reshape(-1)[0]))
        losses.append(float(loss))
        if t % run.eval_every == 0 or t == run.steps:
            val_steps.append(t)
            val_losses.append(validate())
        if progress is not None:
            progress(t, run.steps, losses[-1])
    return {
        "losses": losses,
        "val_steps": val_steps,
        "val_losses": val_losses,
        "val_loss": val_losses[-1],
        "step_time_s": float(np.mean(times[1:])) if len(times) > 1 else math.nan,
        "wall_s": time.perf_counter() - start_wall,
        "bytes_per_step": float(np.mean(sent)),
        "params": model.count_params(net),
    }
