"""Deterministic data-parallel training across processes with jaxcomm.

Every device of every process holds the parameters and a 1/N slice of each
global batch; ``jaxcomm.allreduce_gradients`` averages the gradients over a
``(node, local)`` mesh that spans all processes: processes on ``node``, their
devices on ``local``. ``--algorithm dense`` reduces over both axes in one
``lax.psum``; ``--algorithm hierarchical`` reduce-scatters inside each process,
allreduces 1/L of the data across processes and allgathers inside again.
``--backend xla`` (the default) runs those as JAX collectives (gloo across
processes on CPU); ``--backend ffi`` runs jaxcomm's own schedules (TCP across
processes on CPU). Across CPU processes with jaxlib older than 0.12, XLA's
hierarchical path can return a block of wrong values (jaxcomm warns;
docs/faults.md), so run hierarchical there with ``--backend ffi``.

Data, initial parameters and batch order depend only on ``--seed``, and every
process builds the same global batch, so one process of 8 devices with
``--nodes 2`` computes what 2 processes of 4 devices compute, up to the order
in which the cross-process sum adds its terms.

Run it on 2 local processes of 4 CPU devices, or as 1 process of 8::

    python -m jaxcomm.launch -n 2 --devices-per-process 4 \\
        examples/multihost/train.py --algorithm hierarchical --backend ffi --out /tmp/p2.npz
    python -m jaxcomm.launch -n 1 --devices-per-process 8 \\
        examples/multihost/train.py --algorithm hierarchical --backend ffi --nodes 2 \\
        --out /tmp/p1.npz

Process 0 writes the final parameters to ``--out`` (an ``.npz``).
"""

from __future__ import annotations

import argparse

import jaxcomm.distributed as distributed


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithm", choices=("dense", "hierarchical"), default="dense")
    parser.add_argument(
        "--backend",
        choices=("xla", "ffi"),
        default="xla",
        help="xla: JAX collectives (gloo across CPU processes); ffi: jaxcomm's (TCP)",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--nodes", type=int, default=None, help="rows of the mesh; the process count by default"
    )
    parser.add_argument(
        "--local-devices",
        type=int,
        default=None,
        help="CPU devices per process when not started by jaxcomm.launch --devices-per-process",
    )
    parser.add_argument("--out", default=None, help=".npz path for the final parameters")
    return parser.parse_args(argv)


def make_data(seed: int, examples: int = 2048, features: int = 32, classes: int = 8):
    """Gaussian class blobs; a pure function of ``seed``, the same in every process."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, features)).astype(np.float32)
    labels = rng.integers(classes, size=examples).astype(np.int32)
    inputs = centres[labels] + rng.normal(size=(examples, features)).astype(np.float32)
    return inputs, labels


def init_params(seed: int, features: int, hidden: int, classes: int) -> dict:
    """A 2-layer MLP, initialized in NumPy from ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    return {
        "w1": (rng.normal(size=(features, hidden)) * np.sqrt(2 / features)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.normal(size=(hidden, classes)) * np.sqrt(2 / hidden)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }


def train(args) -> dict:
    """Runs ``args.steps`` steps; returns the final parameters as NumPy arrays."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = distributed.hierarchical_mesh("node", "local", nodes=args.nodes)
    axes = ("node", "local")
    if args.batch % mesh.size:
        raise ValueError(f"--batch {args.batch} is not divisible by {mesh.size} devices")

    algorithm = "hierarchical" if args.algorithm == "hierarchical" else "auto"
    tx = optax.chain(
        jaxcomm.allreduce_gradients(axes, algorithm=algorithm, backend=args.backend),
        optax.sgd(args.lr, momentum=args.momentum),
    )

    def loss_fn(params, x, y):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, opt_state, x, y):
        # This device's own gradient: allreduce_gradients is then the only
        # communication of the step.
        loss, grads = jaxcomm.local_value_and_grad(loss_fn, axes)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axes)

    run = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P(axes), P(axes)),
            out_specs=(P(), P(), P()),
        )
    )

    def global_array(value, spec):
        # Every process holds the whole value; each device takes its slice.
        value = np.asarray(value)
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    inputs, labels = make_data(args.seed)
    params = init_params(args.seed, inputs.shape[1], args.hidden, int(labels.max()) + 1)
    opt_state = jax.tree.map(lambda v: global_array(v, P()), tx.init(params))
    params = jax.tree.map(lambda v: global_array(v, P()), params)
    order = np.random.default_rng(args.seed + 2)
    for i in range(args.steps):
        batch = order.choice(len(inputs), size=args.batch, replace=False)
        x, y = global_array(inputs[batch], P(axes)), global_array(labels[batch], P(axes))
        if i == 0:
            # Every process must issue the same collectives in the same order:
            # stop now, naming the first that differs, rather than hang in it.
            distributed.check_same_collectives(run, params, opt_state, x, y)
        # One step in flight at a time: overlapping CPU collectives can abort.
        params, opt_state, loss = jax.block_until_ready(run(params, opt_state, x, y))
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {float(loss):.6f}", flush=True)
    return {name: _replicated_value(value) for name, value in params.items()}


def _replicated_value(array):
    """The value of a replicated array, after checking this process's copies agree."""
    import numpy as np

    copies = [np.asarray(shard.data) for shard in array.addressable_shards]
    for d, copy in enumerate(copies[1:], start=1):
        if copy.tobytes() != copies[0].tobytes():
            raise AssertionError(f"local device {d} holds different parameters than device 0")
    return copies[0]


def main(argv=None):
    args = parse_args(argv)
    settings = distributed.initialize(local_device_count=args.local_devices)
    # Every process must run with the same flags: stop now, naming the one that differs.
    distributed.check_same_settings(vars(args))
    import jax

    print(
        f"process {settings.process_id}/{settings.num_processes}: "
        f"{jax.local_device_count()} of {jax.device_count()} devices, {args.algorithm} "
        f"on {args.backend}",
        flush=True,
    )
    params = train(args)
    if args.out and settings.process_id == 0:
        import numpy as np

        np.savez(args.out, **params)
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
