"""Does DiLoCo's delayed sync overlap the steps between? A timeline on shaped links.

Starts ``--hosts`` processes on the testbed of ``bench/network.py`` (one
network namespace each, links shaped with ``tc tbf``), each with one CPU
device, and trains ``examples/lm``'s transformer with ``jaxcomm.diloco``
(AdamW inside, the paper's Nesterov outer step) in these configurations, one
after another, on the same batches:

- ``local``: ``sync_every`` beyond the run: no sync, the compute-only step;
- ``sync``: a sync every ``--sync-every`` steps, its update landing
  ``--delay`` steps later, the collective inside the sync step
  (``backend="xla"``: gloo);
- ``overlapped``: the same with ``backend="auto"``: the sync step starts the
  exchange on jaxcomm's transport and the landing step finishes it;
- ``plain``: no delay (``backend="xla"``), the sync step waits for it.

Each first runs ``--sync-every + --delay`` steps untimed (compilation, every
connection opened), then times ``--steps`` (whole cycles: as many syncs as
landings).

Each process times every step (``time.monotonic()``, one step in flight) and
reads ``jaxcomm._ffi.async_timeline()``: when each started exchange was
started, done on the network, waited for and returned. Prints per
configuration the mean step, the median step, the slowest step and the mean
against ``local``'s; writes the rows (``--json``) and a timeline plot
(``--png``): host 0's steps as bars, each started exchange as a span.

    python bench/diloco_overlap.py --rate 10mbit --json o.json --png o.png  # H 100, tau 80
    python bench/diloco_overlap.py --from-json o.json --png o.png

Needs root (namespaces), as ``bench/network.py`` does; says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "bench"), REPO]

import netbed  # noqa: E402  (beside this file)
import timeline  # noqa: E402

CONFIGS = ("local", "overlapped", "sync", "plain")
AXIS = "data"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=", ".join(CONFIGS))
    parser.add_argument("--rate", default="10mbit", help="link rate")
    parser.add_argument("--hosts", type=int, default=4)
    # An exchange of this model at 10 Mbit/s takes 6-8 s, 80 idle-machine steps.
    parser.add_argument("--steps", type=int, default=200, help="timed steps")
    parser.add_argument("--sync-every", type=int, default=100)
    parser.add_argument("--delay", type=int, default=80)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch-per-device", type=int, default=8)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--png", help="write the timeline here")
    parser.add_argument("--from-json", help="no run: table and plot from this JSON file")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a host's process: its config
    args = parser.parse_args(argv)
    args.config_list = [c for c in args.configs.split(",") if c]
    for config in args.config_list:
        if config not in CONFIGS:
            parser.error(f"--configs: unknown {config!r}; choose from {', '.join(CONFIGS)}")
    if not 0 < args.delay < args.sync_every:
        parser.error(f"--delay {args.delay} must be in [1, --sync-every {args.sync_every})")
    try:
        args.rate_bps = netbed.parse_rate(args.rate)
        args.rates = [args.rate_bps]
    except ValueError as e:
        parser.error(str(e))
    args.devices_per_host = 1
    return args


def say(message: str):
    print(f"diloco_overlap: {message}", file=sys.stderr, flush=True)


# -- one host's process -------------------------------------------------------


def worker(args) -> int:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from testbed_worker import data_mesh, emit, join, load_example, placer, progress

    import jaxcomm

    join()
    config = args.worker
    data, model = load_example("lm", "data", "model")
    corpus = data.load_corpus()
    net = model.ByteTransformer(
        layers=args.layers, width=args.width, heads=4, context=64, rngs=nnx.Rngs(0)
    )
    graphdef, params = nnx.split(net, nnx.Param)

    def loss(params, windows):
        logits = nnx.merge(graphdef, params)(windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    mesh = data_mesh(AXIS)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    # local: the first sync after the last step, untimed ones included.
    warm = args.sync_every + args.delay
    every = warm + args.steps + 1 if config == "local" else args.sync_every
    delay = 0 if config in ("local", "plain") else args.delay
    backend = "auto" if config == "overlapped" else "xla"
    tx = jaxcomm.diloco(
        optax.adamw(3e-3), outer, AXIS, sync_every=every, delay=delay, backend=backend
    )

    place = placer(mesh)

    params = jax.tree.map(lambda v: place(v, P()), params)
    with jax.set_mesh(mesh):
        specs = jaxcomm.state_specs(jax.eval_shape(tx.init, params), AXIS)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs))(params)

    def step(params, state, windows):
        grads = jax.grad(loss)(jaxcomm.local_params(state), windows)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
    )
    rng = np.random.default_rng(1)  # the same batches on every host and configuration
    n = mesh.size * args.batch_per_device
    # Not timed: a cycle and a landing first, which compile the step and open
    # the connections of both the sync and the landing.
    batches = [data.sample_windows(corpus.train, n, 65, rng) for _ in range(warm + args.steps)]
    steps = []
    for t, batch in enumerate(batches):
        windows = place(batch, P(AXIS))
        began = time.monotonic()
        params, state = jax.block_until_ready(run(params, state, windows))  # one in flight
        if t >= warm:
            steps.append((began, time.monotonic()))
        elif t == 0:
            progress(f"{config}: compiled")
    exchanges = timeline.exchanges_since(steps[0][0])
    times = [b - a for a, b in steps]
    emit(
        {
            "config": config,
            "hosts": jax.process_count(),
            "steps": args.steps,
            "sync_every": every,
            "delay": delay,
            "mean_step_s": statistics.fmean(times),
            "median_step_s": statistics.median(times),
            "max_step_s": max(times),
            "step_times": steps,
            "exchanges": exchanges,
        }
    )
    return 0


# -- the driver --------------------------------------------------------------


def run_inside(args) -> int:
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    return netbed.run_testbed(
        lambda rate, rows: [(config, [*argv, "--worker", config]) for config in args.config_list],
        netbed.Layout.of(args),
        say=say,
    )


def report(args, rows: list[dict]):
    runs = {r["config"]: r for r in rows if r.get("config") in CONFIGS}
    link = next((r["measured_bps"] for r in rows if r.get("config") == "link"), None)
    local = runs.get("local", {}).get("mean_step_s")
    print(
        f"\n{netbed.format_rate(rows[0]['rate_bps'])}"
        + (f" (one TCP stream {link / 1e6:.1f} Mbit/s)" if link else "")
    )
    print(f"{'config':<12}{'mean s':>9}{'median s':>10}{'max s':>8}{'vs local':>10}")
    for name in CONFIGS:
        if name not in runs:
            continue
        r = runs[name]
        vs = f"{r['mean_step_s'] / local:.3f}" if local else "-"
        print(
            f"{name:<12}{r['mean_step_s']:>9.3f}{r['median_step_s']:>10.3f}"
            f"{r['max_step_s']:>8.2f}{vs:>10}"
        )
        busy, idle = split_steps(r)
        if busy and idle:
            ratio = statistics.fmean(busy) / statistics.fmean(idle)
            print(
                f"    steps while an exchange was on the network: {len(busy)}, mean "
                f"{statistics.fmean(busy):.3f} s; the others: {len(idle)}, mean "
                f"{statistics.fmean(idle):.3f} s ({ratio:.3f}x)"
            )
        for e in r.get("exchanges", []):
            first = r["step_times"][0][0]
            print(
                f"    exchange started {e['started'] - first:7.2f} s, on the network "
                f"{e['reduced'] - e['started']:5.2f} s, waited for at "
                f"{e['landed'] - first:7.2f} s, returned after {e['returned'] - e['landed']:.3f} s"
            )
    if args.png:
        plot(runs, args.png)


def split_steps(run: dict) -> tuple[list, list]:
    """The run's step times, split by whether one of its started exchanges
    was on the network during the step: the same run's steps, so the load
    of the machine drifts alike under both."""
    spans = [(e["started"], e["reduced"]) for e in run.get("exchanges", [])]
    busy, idle = [], []
    for a, b in run["step_times"]:
        (busy if any(a < end and b > start for start, end in spans) else idle).append(b - a)
    return busy, idle


def plot(runs: dict, path: str):
    timeline.plot(
        {n: runs[n] for n in CONFIGS if n in runs},
        path,
        "DiLoCo steps; orange: a started exchange on the network, red: its landing step waits",
    )
    say(f"timeline in {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.from_json:
        with open(args.from_json) as f:
            report(args, json.load(f))
        return 0
    if os.environ.get(netbed.INSIDE_ENV) == "1":
        return run_inside(args)
    if args.json is None:
        say("--json is needed for a run (the rows go there)")
        return 2
    argv = sys.argv[1:] if argv is None else list(argv)
    code = netbed.rerun_isolated(__file__, argv, timeout_s=args.timeout + 60, say=say)
    if os.path.exists(args.json) and os.path.getsize(args.json):
        with open(args.json) as f:
            report(args, json.load(f))
    return code


if __name__ == "__main__":
    sys.exit(main())
