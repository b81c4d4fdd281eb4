"""What jaxcomm's gradient transforms cost per step, on 8 CPU devices.

Each configuration is one jitted shard_map step that takes per-device
gradients, runs the transform chain and applies the update (no model: the
gradients are inputs, so only communication and optimizer work is timed).
The gradient trees have the shapes of real models, from the Flax
definitions in jaxcomm.costmodel.profiles: ResNet-50 (161 leaves, 25.5 M
parameters) and AlexNet-BN (26 leaves, 61 M parameters, few very large).

Each configuration is timed alternately with the baseline (a hand-written
lax.pmean per leaf + optax.sgd), one configuration at a time; the ratio
reported is the median of the per-round ratios: this machine is noisy, and
only ratios measured side by side mean anything. Every step is waited
for (two XLA CPU collectives in flight can abort; see README).

    python bench/overhead.py                       # both models, default configs
    python bench/overhead.py --models resnet50 --rounds 9 --json /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
from collections.abc import Callable

import _common

_common.host_devices()  # before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm.costmodel import profiles, time_rounds  # noqa: E402

LR = 1e-3


def gradient_shapes(model: str) -> list[tuple[int, ...]]:
    """Leaf shapes in tree (forward) order, from the model's Flax definition."""
    profile = {"resnet50": profiles.resnet50, "alexnet": profiles.alexnet_bn}[model]()
    return [shape for layer in profile.layers for _, shape in layer.params]


def configurations() -> dict[str, Callable[[], optax.GradientTransformation]]:
    """name -> factory of the transform chain. 'pmean' is the hand-written baseline."""
    sgd = optax.sgd(LR)
    dense = jaxcomm.allreduce_gradients

    configs = {
        "pmean": None,  # lax.pmean per leaf, then optax.sgd
        "dense": lambda: optax.chain(dense("data"), sgd),
        "dense check_finite=False": lambda: optax.chain(dense("data", check_finite=False), sgd),
        "unfused(theta=0)": lambda: optax.chain(dense("data", bucket_bytes=0), sgd),
        "fused(theta=inf)": lambda: optax.chain(dense("data", bucket_bytes=math.inf), sgd),
        "fp16": lambda: optax.chain(dense("data", wire_dtype=jnp.float16), sgd),
        "bf16": lambda: optax.chain(dense("data", wire_dtype=jnp.bfloat16), sgd),
        "fp16+ef": lambda: optax.chain(
            dense("data", wire_dtype=jnp.float16, error_feedback=True), sgd
        ),
        "double_buffering": lambda: optax.chain(dense("data", double_buffering=True), sgd),
        "ffi": lambda: optax.chain(dense("data", backend="ffi"), sgd),
        # 'auto' takes ffi for a 16-bit wire on CPU; XLA's own path for comparison.
        "fp16 (xla)": lambda: optax.chain(
            dense("data", wire_dtype=jnp.float16, backend="xla"), sgd
        ),
        "ffi unfused": lambda: optax.chain(dense("data", backend="ffi", bucket_bytes=0), sgd),
        "csc d=0.15 (ffi)": lambda: jaxcomm.chunk_sparse(
            optax.sgd(LR, momentum=0.9), "data", density=0.15, backend="ffi"
        ),
        # The same optimizer as pmean's: what chunk_sparse itself costs.
        "csc d=0.15 sgd (ffi)": lambda: jaxcomm.chunk_sparse(
            optax.sgd(LR), "data", density=0.15, backend="ffi"
        ),
        "fp8": lambda: optax.chain(dense("data", wire_dtype=jnp.float8_e4m3fn), sgd),
        "powersgd r4": lambda: optax.chain(
            jaxcomm.powersgd("data", rank=4, start_step=0, mask=None), sgd
        ),
        # A step that does not sync: local work only, nothing to communicate.
        "diloco (no sync)": lambda: jaxcomm.diloco(
            optax.sgd(LR), optax.sgd(0.7, momentum=0.9, nesterov=True), "data", sync_every=10**6
        ),
    }
    return configs


def build_step(tx, mesh, params, n: int):
    """A jitted step (params, state, grads) -> (params, state), and its initial state."""
    if tx is None:

        def local(p, s, g):
            g = jax.tree.map(lambda x: jax.lax.pmean(x[0], "data"), g)
            u, s = optax.sgd(LR).update(g, s, p)
            return optax.apply_updates(p, u), s

        state = optax.sgd(LR).init(params)
    else:

        def local(p, s, g):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s

        with jax.set_mesh(mesh):
            state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    step = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    return step, state


def random_tree(shapes, mesh, key, rows: int | None):
    """float32 arrays of `shapes` (with a leading row per device when rows is
    given), made on the devices."""
    leaves = []
    for i, shape in enumerate(shapes):
        full = shape if rows is None else (rows, *shape)
        spec = P() if rows is None else P("data")
        make = jax.jit(
            lambda k, full=full: 1e-3 * jax.random.normal(k, full, jnp.float32),
            out_shardings=NamedSharding(mesh, spec),
        )
        leaves.append(make(jax.random.fold_in(key, i)))
    return leaves


def measure(model: str, names: list[str], rounds: int, progress) -> dict[str, list[float]]:
    """Times every configuration against the baseline, alternately, one
    configuration at a time (AlexNet-shaped state for all of them at once
    would not fit in memory). Returns name -> (times, baseline times)."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    shapes = gradient_shapes(model)
    params0 = random_tree(shapes, mesh, jax.random.key(0), None)
    grads = random_tree(shapes, mesh, jax.random.key(1), n)
    factories = configurations()

    def build(name):
        tx = factories[name]() if factories[name] else None
        step, state = build_step(tx, mesh, jax.tree.map(jnp.copy, params0), n)
        params, state = jax.block_until_ready(step(jax.tree.map(jnp.copy, params0), state, grads))
        return [step, params, state]

    def advance(run):
        """One step of `run`, whose params and state then carry on from its result."""
        return _common.carried(run, grads)

    baseline = build(names[0])
    times = {}
    for name in names[1:]:
        progress(f"{model}: {name}")
        run = build(name)
        # Two functions in rotated rounds: baseline and run alternate going first.
        base, own = time_rounds([advance(baseline), advance(run)], reps=rounds, warmup=0)
        times[name] = (own, base, fresh_mib(advance(run)), fresh_mib(advance(baseline)))
        del run
    return times


def fresh_mib(call) -> float:
    """MiB of memory the process touched for the first time during one call
    (minor page faults x page size): XLA CPU allocates a step's outputs and
    temporaries afresh, and above glibc's mmap threshold each one comes from
    the kernel as new pages, faulted in and zeroed on first write. Beside
    the passes over the gradient, this is the step's other CPU cost."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(call())
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults * resource.getpagesize() / 2**20


def report(model: str, times: dict, baseline: str) -> list[dict]:
    rows = []
    print(f"\n{model}: median step time, each configuration alternated with {baseline}")
    print(
        f"{'configuration':<20} {'ms':>9} {baseline + ' ms':>10} {'ratio':>7}"
        f" {'fresh MiB':>10} {baseline + ' MiB':>11}"
    )
    for name, (ts, base, fresh, fresh_base) in times.items():
        ratio = statistics.median([t / b for t, b in zip(ts, base, strict=True)])
        med, med_base = statistics.median(ts), statistics.median(base)
        rows.append(
            {
                "model": model,
                "config": name,
                "time_s": med,
                "baseline_time_s": med_base,
                "ratio_to_" + baseline: ratio,
                "fresh_mib": fresh,
                "baseline_fresh_mib": fresh_base,
            }
        )
        print(
            f"{name:<20} {1e3 * med:>9.1f} {1e3 * med_base:>10.1f} {ratio:>7.3f}"
            f" {fresh:>10.0f} {fresh_base:>11.0f}"
        )
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50,alexnet", help="resnet50, alexnet")
    parser.add_argument("--configs", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds per configuration")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    known = list(configurations())
    args.configs = known if args.configs is None else args.configs.split(",")
    unknown = [c for c in args.configs if c not in known]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {known}")
    if "pmean" not in args.configs:
        args.configs.insert(0, "pmean")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if jax.device_count() != 8:
        print(f"note: {jax.device_count()} devices (8 expected)", file=sys.stderr)

    def progress(msg):
        print(f"  .. {msg}", file=sys.stderr, flush=True)

    rows = []
    for model in args.models.split(","):
        times = measure(model, args.configs, args.rounds, progress)
        rows += report(model, times, "pmean")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
