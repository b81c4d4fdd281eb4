"""One host of ``bench/time_to_quality.py``: trains one configuration, validates, prints rows.

Started in each host's network namespace with the variables ``python -m
jaxcomm.launch`` sets, as ``bench/network_worker.py`` is
(``bench/testbed_worker.py``). Trains a model
data-parallel over every device of every host with one gradient-exchange
configuration for ``--steps`` steps, one step in flight, and every
``--eval-every`` steps (and at step 0 and the last) measures validation
quality on fixed held-out data. Process 0 prints one ``@row {json}`` line per
evaluation and a last summary row; progress goes to stderr.

Models (their data and network come from ``examples/``, imported, not copied):

- ``lm``: ``examples/lm``'s byte-level transformer on the Python standard
  library's source (``data.load_corpus``), AdamW; quality = validation loss
  (nats per byte, lower is better) on fixed held-out windows.
- ``digits``: scikit-learn's 8x8 digits with ``examples/digits``' split
  (``train.load_digits``) and a wider MLP than that example's (64 -> width ->
  width -> 10, so that the gradient is large enough to load the link),
  momentum SGD; quality = held-out accuracy (higher is better).

Timing: the step is compiled ahead of time (``compile_s``) and run once on
throwaway copies of the initial state (``warmup_s``: gloo's first
connections), then training starts from the initial state. ``wall_s`` in a
row is the training time since the first step began: batches and steps,
not the evaluations.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from typing import Any, NamedTuple

from testbed_worker import (
    data_mesh,
    describe_error,
    emit,
    join,
    load_example,
    placer,
    progress,
)

AXIS = "data"
MODELS = ("lm", "digits")
# name -> what the exchange is; make_optimizer builds them.
CONFIGS = {
    "dense": "allreduce_gradients, float32 wire",
    "bf16": "allreduce_gradients, bfloat16 wire",
    "bf16_ef": "allreduce_gradients, bfloat16 wire, error feedback",
    "chunk_sparse": "chunk_sparse density 0.15 around the optimizer, dense warm-up",
    "powersgd_r1": "powersgd rank 1, error feedback",
    "powersgd_r1_noef": "powersgd rank 1, no error feedback",
    "powersgd_r4": "powersgd rank 4, error feedback",
    "powersgd_r4_noef": "powersgd rank 4, no error feedback",
    "diloco_h10": "diloco, sync every 10 steps",
    "diloco_h50": "diloco, sync every 50 steps",
    "streaming_diloco_h50_f5": "streaming diloco, sync every 50 steps in 5 fragments",
    "sparseloco_h50": "sparseloco, sync every 50 steps, 2% of each chunk at 2 bits",
    "local": "no communication at all: diloco's step with no sync in the run (compute only)",
}
# Variants of the PowerSGD, DiLoCo and SparseLoCo configurations, named by
# their options (e.g. powersgd_r4_warm50, diloco_h50_olr1.0_om0.8,
# diloco_h50_d5_a0.5_wint4, sparseloco_h50_k3_b4): parse_config reads them.
# _d: delay (tau), _a: mixing (alpha), _w: the pseudo-gradient's wire
# (WIRES), _ffi: jaxcomm's own transport (TCP across processes) instead of
# XLA's collectives; _k: the density in percent, _b: the value bits.
VARIANTS = (
    "powersgd_r{rank}[_noef][_warm{dense steps first}][_denseemb]",
    "[streaming_]diloco_h{sync every}[_f{fragments}][_olr{outer lr}][_om{outer momentum}]"
    "[_d{delay}][_a{mixing}][_w{wire}][_ffi]",
    "sparseloco_h{sync every}[_k{density percent}][_b{value bits}][_d{delay}][_a{mixing}][_ffi]",
)
# The wire names of _w{wire}: what jaxcomm.diloco's wire_dtype gets.
WIRES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8": "float8_e4m3fn",
    "fp8e5": "float8_e5m2",
    "int8": "int8",
    "int4": "int4",
}
_NUMBER = r"\d+(?:\.\d+)?"
_OVERLAP = rf"(?:_d(?P<delay>\d+))?(?:_a(?P<mixing>{_NUMBER}))?"
POWERSGD = re.compile(
    r"powersgd_r(?P<rank>\d+)(?P<noef>_noef)?(?:_warm(?P<warm>\d+))?(?P<denseemb>_denseemb)?"
)
DILOCO = re.compile(
    r"(?:streaming_)?diloco_h(?P<sync_every>\d+)(?:_f(?P<fragments>\d+))?"
    rf"(?:_olr(?P<outer_lr>{_NUMBER}))?(?:_om(?P<outer_momentum>{_NUMBER}))?{_OVERLAP}"
    rf"(?:_w(?P<wire>{'|'.join(WIRES)}))?(?P<ffi>_ffi)?"
)
SPARSELOCO = re.compile(
    rf"sparseloco_h(?P<sync_every>\d+)(?:_k(?P<density>{_NUMBER}))?(?:_b(?P<value_bits>\d+))?"
    rf"{_OVERLAP}(?P<ffi>_ffi)?"
)


SCHEDULES = ("constant", "cosine")


def learning_rate(peak: float, schedule: str, steps: int):
    """``peak``, or an optax schedule reaching it (see ``--schedule``).

    Examples:
      >>> lr = learning_rate(1.0, "cosine", 200)
      >>> [round(float(lr(t)), 3) for t in (0, 10, 105, 200)]
      [0.0, 1.0, 0.5, 0.0]
    """
    import optax

    if schedule == "constant":
        return peak
    return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 20), steps, 0.0)


def adamw_frozen_variance(lr, freeze_after: int, weight_decay: float = 1e-4):
    """AdamW whose second moment stops updating after ``freeze_after`` steps
    (1-bit Adam's idea): from then on the step is linear in the gradient."""
    import jax
    import jax.numpy as jnp
    import optax

    b1, b2, eps = 0.9, 0.999, 1e-8

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update(grads, state, params=None):
        del params
        count = state.count + 1
        live = count <= freeze_after
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(
            lambda v, g: jnp.where(live, b2 * v + (1 - b2) * g * g, v), state.nu, grads
        )
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** jnp.minimum(count, freeze_after).astype(jnp.float32)
        out = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return out, optax.ScaleByAdamState(count, mu, nu)

    return optax.chain(
        optax.GradientTransformation(init, update),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(lr),
    )


class PowerSGDConfig(NamedTuple):
    rank: int
    error_feedback: bool
    start_step: int  # dense steps before compression starts
    dense_embeddings: bool = False  # lm: embed and position averaged densely


class DiLoCoConfig(NamedTuple):
    sync_every: int
    fragments: int
    # The paper's outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9.
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    delay: int = 0  # tau: steps between a sync and its outer update
    mixing: float = 0.0  # alpha: share of the local params kept at the update
    wire: str | None = None  # a WIRES value; None: float32
    backend: str = "xla"  # "ffi": jaxcomm's own transport


class SparseLoCoConfig(NamedTuple):
    sync_every: int
    density: float = 0.02  # fraction of each chunk sent
    value_bits: int = 2
    delay: int = 0
    mixing: float = 0.0
    backend: str = "xla"


def parse_config(name: str):
    """The name itself for a configuration of ``CONFIGS`` other than PowerSGD,
    DiLoCo and SparseLoCo; their options (``PowerSGDConfig``,
    ``DiLoCoConfig``, ``SparseLoCoConfig``) for those and their variants
    (``VARIANTS``). Raises ValueError for anything else.

    Examples:
      >>> options = parse_config("diloco_h50_d5_a0.5_wint4")
      >>> options.sync_every, options.delay, options.mixing, options.wire, options.backend
      (50, 5, 0.5, 'int4', 'xla')
      >>> options = parse_config("sparseloco_h50_k3_ffi")
      >>> options.density, options.value_bits, options.backend
      (0.03, 2, 'ffi')
    """
    if match := POWERSGD.fullmatch(name):
        return PowerSGDConfig(
            rank=int(match["rank"]),
            error_feedback=not match["noef"],
            start_step=int(match["warm"] or 0),
            dense_embeddings=bool(match["denseemb"]),
        )
    if match := DILOCO.fullmatch(name):
        found = {k: v for k, v in match.groupdict().items() if v is not None}
        return DiLoCoConfig(
            sync_every=int(found.pop("sync_every")),
            fragments=int(found.pop("fragments", 1)),
            delay=int(found.pop("delay", 0)),
            wire=WIRES[found.pop("wire")] if "wire" in found else None,
            backend="ffi" if found.pop("ffi", None) else "xla",
            **{k: float(v) for k, v in found.items()},
        )
    if match := SPARSELOCO.fullmatch(name):
        return SparseLoCoConfig(
            sync_every=int(match["sync_every"]),
            density=float(match["density"]) / 100 if match["density"] else 0.02,
            value_bits=int(match["value_bits"] or 2),
            delay=int(match["delay"] or 0),
            mixing=float(match["mixing"] or 0.0),
            backend="ffi" if match["ffi"] else "xla",
        )
    if name in CONFIGS:
        return name
    raise ValueError(
        f"unknown configuration {name!r}: choose from {', '.join(CONFIGS)} or a variant "
        f"{' or '.join(VARIANTS)}"
    )


def config_name(name: str) -> str:
    """``name`` if ``parse_config`` reads it (argparse's type check)."""
    try:
        parse_config(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="lm")
    parser.add_argument(
        "--config",
        type=config_name,
        default="dense",
        help=f"{', '.join(CONFIGS)}; or a variant {' or '.join(VARIANTS)}; "
        f"wires: {', '.join(f'{k} ({v})' for k, v in WIRES.items())}",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument(
        "--stop-at-quality",
        type=float,
        help="stop after the first evaluation at or past this quality (at or below it "
        "for a loss, at or above for an accuracy); --steps is then the most it runs",
    )
    parser.add_argument("--batch-per-device", type=int, default=16)
    parser.add_argument("--width", type=int, default=192, help="lm: model width; digits: hidden")
    parser.add_argument("--layers", type=int, default=3, help="lm: transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="lm: attention heads")
    parser.add_argument("--context", type=int, default=64, help="lm: window length")
    parser.add_argument("--eval-windows", type=int, default=256, help="lm: held-out windows")
    parser.add_argument("--lr", type=float, help="optimizer step (lm: 3e-3 AdamW; digits: 0.05)")
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="constant",
        help="the step over the run: constant, or cosine (a linear warm-up over the "
        "first twentieth, then a cosine decay to 0 at --steps)",
    )
    parser.add_argument(
        "--freeze-variance-after",
        type=int,
        default=0,
        help="lm: AdamW's second moment stops updating after this many steps (0: never)",
    )
    parser.add_argument(
        "--eval-local",
        action="store_true",
        help="diloco: also validate each device's own params the step before each sync "
        "(their mean goes in the summary row's before_sync)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class Task(NamedTuple):
    """A model, its data and how its quality is measured."""

    params: Any  # initial parameters, NumPy leaves
    loss: Any  # (params, *batch) -> mean loss over this device's batch
    quality: Any  # (params, *held_out) -> this device's share of the quality
    held_out: tuple  # NumPy arrays, split over the devices
    next_batch: Any  # (step) -> tuple of NumPy arrays, the global batch
    base_optimizer: Any  # optax optimizer the exchange wraps
    quality_name: str
    higher_is_better: bool


def lm_task(args, devices: int) -> Task:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    data, model = load_example("lm", "data", "model")
    corpus = data.load_corpus()
    net = model.ByteTransformer(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        context=args.context,
        rngs=nnx.Rngs(args.seed),
    )
    graphdef, params = nnx.split(net, nnx.Param)

    def loss(params, windows):
        logits = nnx.merge(graphdef, params)(windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    if args.eval_windows % devices:
        raise ValueError(f"--eval-windows {args.eval_windows} is not divisible by {devices}")
    # One byte more than the context: inputs are [:-1], targets [1:].
    val = data.fixed_windows(corpus.val, args.eval_windows, args.context + 1)
    rng = np.random.default_rng(args.seed + 1)  # the same batches on every host
    lr = learning_rate(args.lr or 3e-3, args.schedule, args.steps)

    def next_batch(step):
        del step
        count = args.batch_per_device * devices
        return (data.sample_windows(corpus.train, count, args.context + 1, rng),)

    return Task(
        params=jax.tree.map(np.asarray, params),
        loss=loss,
        quality=loss,
        held_out=(val,),
        next_batch=next_batch,
        base_optimizer=(
            adamw_frozen_variance(lr, args.freeze_variance_after)
            if args.freeze_variance_after
            else optax.adamw(lr)
        ),
        quality_name="val_loss",
        higher_is_better=False,
    )


def digits_task(args, devices: int) -> Task:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    (digits,) = load_example("digits", "train")
    x_train, y_train, x_test, y_test = digits.load_digits(args.seed)
    keep = len(y_test) - len(y_test) % devices  # equal shares, so the mean of means is the mean
    x_test, y_test = x_test[:keep], y_test[:keep]

    class WideMLP(nnx.Module):
        def __init__(self, width: int, rngs: nnx.Rngs):
            self.hidden1 = nnx.Linear(64, width, rngs=rngs)
            self.hidden2 = nnx.Linear(width, width, rngs=rngs)
            self.logits = nnx.Linear(width, 10, rngs=rngs)

        def __call__(self, x):
            return self.logits(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))

    graphdef, params = nnx.split(WideMLP(args.width, nnx.Rngs(args.seed)), nnx.Param)

    def loss(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(nnx.merge(graphdef, params)(x), -1) == y)

    rng = np.random.default_rng(args.seed + 1)
    batch = args.batch_per_device * devices
    order: list = []

    def next_batch(step):
        del step
        if len(order) < batch:  # a new epoch: a fresh permutation
            order[:] = list(rng.permutation(len(y_train)))
        idx = np.array(order[:batch])
        del order[:batch]
        return x_train[idx], y_train[idx]

    return Task(
        params=jax.tree.map(np.asarray, params),
        loss=loss,
        quality=accuracy,
        held_out=(x_test, y_test),
        next_batch=next_batch,
        base_optimizer=optax.sgd(
            learning_rate(args.lr or 0.05, args.schedule, args.steps), momentum=0.9
        ),
        quality_name="val_accuracy",
        higher_is_better=True,
    )


def make_optimizer(config: str, base, steps: int):
    """The configuration's optimizer around ``base``, and whether it is DiLoCo
    (whose gradient is taken at each device's own params)."""
    import jax.numpy as jnp
    import optax

    import jaxcomm

    # xla (gloo across processes) unless a variant asks for ffi.
    if config in ("dense", "bf16", "bf16_ef"):
        wire = None if config == "dense" else jnp.bfloat16
        reduce = jaxcomm.allreduce_gradients(
            AXIS, wire_dtype=wire, error_feedback=config == "bf16_ef", backend="xla"
        )
        return optax.chain(reduce, base), False
    if config == "chunk_sparse":
        # examples/lm's setting: density 0.15, 1024-element chunks, dense for
        # the first tenth of the run (30 of its 300 steps).
        return jaxcomm.chunk_sparse(
            base, AXIS, density=0.15, chunk_size=1024, warmup_steps=steps // 10, backend="xla"
        ), False
    options = parse_config(config)
    if isinstance(options, PowerSGDConfig):
        reduce = jaxcomm.powersgd(
            AXIS,
            rank=options.rank,
            start_step=options.start_step,
            error_feedback=options.error_feedback,
            mask=not_embeddings if options.dense_embeddings else None,
            backend="xla",
        )
        return optax.chain(reduce, base), False
    if isinstance(options, DiLoCoConfig | SparseLoCoConfig):
        # What the two share: when they sync, when the update lands, how.
        rounds = {
            "sync_every": options.sync_every,
            "delay": options.delay,
            "mixing": options.mixing,
            "backend": options.backend,
        }
    if isinstance(options, DiLoCoConfig):
        outer = optax.sgd(options.outer_lr, momentum=options.outer_momentum, nesterov=True)
        return jaxcomm.diloco(
            base, outer, AXIS, fragments=options.fragments, wire_dtype=options.wire, **rounds
        ), True
    if isinstance(options, SparseLoCoConfig):
        return jaxcomm.sparseloco(
            base, AXIS, density=options.density, value_bits=options.value_bits, **rounds
        ), True
    if config == "local":
        # The compute-only reference: DiLoCo's step with its sync after the
        # last step, so that no step of the run communicates (the global
        # params, which the evaluations read, stay the initial ones).
        outer = optax.sgd(1.0)
        return jaxcomm.diloco(base, outer, AXIS, sync_every=steps + 1, backend="xla"), True
    raise ValueError(f"unknown configuration {config!r}")


def not_embeddings(params):
    """powersgd's mask: every leaf but those under the LM's tied ``embed``
    and its ``position`` table (docs/powersgd.md)."""
    import jax

    return jax.tree_util.tree_map_with_path(
        lambda path, _: path[0].key not in ("embed", "position"), params
    )


def scalar(x) -> float:
    """A replicated global array's value, read from this process's copy."""
    import numpy as np

    return float(np.asarray(x.addressable_data(0)).reshape(-1)[0])


def run(args):
    import jax
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = data_mesh(AXIS)
    n = mesh.size
    task = {"lm": lm_task, "digits": digits_task}[args.model](args, n)
    tx, is_diloco = make_optimizer(args.config, task.base_optimizer, args.steps)
    param_count = sum(v.size for v in jax.tree.leaves(task.params))
    row = {
        "model": args.model,
        "config": args.config,
        "steps": args.steps,
        "stop_at_quality": args.stop_at_quality,
        "schedule": args.schedule,
        "hosts": jax.process_count(),
        "devices": n,
        "params": int(param_count),
        "quality_name": task.quality_name,
        "higher_is_better": task.higher_is_better,
    }

    place = placer(mesh)

    def initial_params():
        return jax.tree.map(lambda v: place(v, P()), task.params)

    with jax.set_mesh(mesh):
        shapes = jax.eval_shape(tx.init, task.params)
    specs = jaxcomm.state_specs(shapes, AXIS)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs))

    def step(params, opt_state, *batch):
        if is_diloco:
            # DiLoCo: this device's own params, kept in the state.
            loss, grads = jax.value_and_grad(task.loss)(jaxcomm.local_params(opt_state), *batch)
        else:
            # This device's own gradient: the exchange is the only communication.
            loss, grads = jaxcomm.local_value_and_grad(task.loss, AXIS)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

    batch_specs = tuple(P(AXIS) for _ in task.held_out)
    train_step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, *batch_specs),
            out_specs=(P(), specs, P()),
        ),
        donate_argnums=(0, 1),
    )

    def evaluate_fn(params, *held_out):
        return jax.lax.pmean(task.quality(params, *held_out), AXIS)

    evaluate = jax.jit(
        jax.shard_map(evaluate_fn, mesh=mesh, in_specs=(P(), *batch_specs), out_specs=P())
    )
    held_out = tuple(place(v, P(AXIS)) for v in task.held_out)
    before_sync = local_evaluation(args, task, mesh, specs, place) if is_diloco else None

    def next_batch(t):
        return tuple(place(v, P(AXIS)) for v in task.next_batch(t))

    start = time.perf_counter()
    params = initial_params()
    opt_state = init(params)
    compiled = train_step.lower(params, opt_state, *next_batch(0)).compile()
    row["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    # Throwaway copies (the step donates them): the first run of the program
    # opens gloo's connections.
    jax.block_until_ready(compiled(params, opt_state, *next_batch(0)))
    row["warmup_s"] = time.perf_counter() - start
    progress(
        f"{args.model} {args.config}: {param_count:,} parameters, {n} devices, "
        f"compile {row['compile_s']:.1f} s, warm-up step {row['warmup_s']:.2f} s"
    )

    params = initial_params()
    opt_state = init(params)
    wall, step_times, sent, losses = 0.0, [], [], []

    def report(t):
        quality = scalar(jax.block_until_ready(evaluate(params, *held_out)))
        emit(
            {
                **row,
                "step": t,
                "wall_s": wall,
                "quality": quality,
                "train_loss": losses[-1] if losses else math.nan,
                "bytes_sent": float(sum(sent)),
            }
        )
        last = step_times[-1] if step_times else 0.0
        progress(
            f"{args.model} {args.config} step {t}/{args.steps}: {task.quality_name} "
            f"{quality:.4f}, wall {wall:.1f} s, last step {last:.3f} s"
        )
        return quality

    def good_enough(quality):
        if args.stop_at_quality is None:
            return False
        if task.higher_is_better:
            return quality >= args.stop_at_quality
        return quality <= args.stop_at_quality

    report(0)
    quality, t = math.nan, 0
    for t in range(1, args.steps + 1):
        began = time.perf_counter()
        batch = next_batch(t)
        stepped = time.perf_counter()
        # One step in flight: overlapping CPU collectives can abort.
        params, opt_state, loss = jax.block_until_ready(compiled(params, opt_state, *batch))
        done = time.perf_counter()
        step_times.append(done - stepped)
        wall += done - began
        sent.append(scalar(jaxcomm.get_stats(opt_state).bytes_sent))
        losses.append(scalar(loss))
        if before_sync is not None:
            before_sync.record(t, opt_state)
        if t % args.eval_every == 0 or t == args.steps:
            quality = report(t)
            if good_enough(quality):
                break
    emit(
        {
            **row,
            "summary": True,
            "steps_run": t,
            "stopped_early": t < args.steps,
            "wall_s": wall,
            "quality": quality,
            "step_s": statistics.median(step_times),
            **sync_and_local_steps(step_times, sent),
            "bytes_per_step": float(np.mean(sent)),
            "train_loss_last": losses[-1],
            **({"before_sync": before_sync.rows} if before_sync is not None else {}),
        }
    )


class LocalEvaluation:
    """DiLoCo's devices' own params validated the step before each sync (the
    mean over devices of each one's quality on all the held-out data), to
    set against the averaged params' quality the step after."""

    def __init__(self, evaluate, held_out, sync_every: int):
        self.evaluate, self.held_out, self.sync_every = evaluate, held_out, sync_every
        self.rows: list[dict] = []

    def record(self, t: int, opt_state):
        import jax

        if (t + 1) % self.sync_every == 0:
            quality = scalar(jax.block_until_ready(self.evaluate(opt_state, *self.held_out)))
            self.rows.append({"step": t, "local_quality": quality})


def local_evaluation(args, task, mesh, specs, place):
    """A ``LocalEvaluation`` when ``--eval-local`` asks for one, else None."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    if not args.eval_local:
        return None
    options = parse_config(args.config)
    if not isinstance(options, DiLoCoConfig | SparseLoCoConfig):
        raise ValueError(f"--eval-local: {args.config} has no syncs")
    if getattr(options, "fragments", 1) != 1:
        raise ValueError("--eval-local: streaming DiLoCo syncs a fragment at a time")

    def evaluate_fn(opt_state, *held_out):
        own = task.quality(jaxcomm.local_params(opt_state), *held_out)
        return jax.lax.pmean(own, AXIS)

    replicated = tuple(P() for _ in task.held_out)
    evaluate = jax.jit(
        jax.shard_map(evaluate_fn, mesh=mesh, in_specs=(specs, *replicated), out_specs=P())
    )
    held_out = tuple(place(v, P()) for v in task.held_out)
    return LocalEvaluation(evaluate, held_out, options.sync_every)


def sync_and_local_steps(step_times, sent) -> dict:
    """The median step that sent bytes and the median one that sent none
    (DiLoCo's sync steps and its local ones), and the mean step; each of the
    first two None unless the run has both kinds.

    Examples:
      >>> sync_and_local_steps([0.25, 0.5, 0.75, 1.0], [0, 8, 0, 8])
      {'sync_step_s': 0.75, 'local_step_s': 0.5, 'mean_step_s': 0.625}
    """
    syncs = [t for t, b in zip(step_times, sent, strict=True) if b > 0]
    local = [t for t, b in zip(step_times, sent, strict=True) if b == 0]
    both = bool(syncs and local)
    return {
        "sync_step_s": statistics.median(syncs) if both else None,
        "local_step_s": statistics.median(local) if both else None,
        "mean_step_s": statistics.fmean(step_times),
    }


def main(argv=None):
    args = parse_args(argv)
    join()
    try:
        run(args)
    except Exception as e:  # noqa: BLE001  (a failing configuration is a result)
        progress(f"{args.model} {args.config}: {describe_error(e)}")
        emit({"model": args.model, "config": args.config, "error": describe_error(e)})
        raise


if __name__ == "__main__":
    main()
