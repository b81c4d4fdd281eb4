"""What a diloco step that does not sync costs, next to a plain local step, on 8 CPU devices.

Between syncs every device only runs its inner optimizer on its own params,
so such a step should cost about what that inner step costs by itself. Three
jitted shard_map steps on the same per-device gradients, params and state
donated, are timed in alternating rounds (one step in flight):

- ``local``: a hand-written inner step on per-device rows (the local params
  and the inner state, one row per device), the params passed through;
- ``diloco``: ``jaxcomm.diloco`` with ``sync_every`` larger than the run, the
  caller applying its (zero) updates with ``optax.apply_updates``;
- ``dense``: ``allreduce_gradients`` then the inner optimizer, every step.

It prints the median step times with the median per-round ratios to
``local``, the fastest times with their ratio (the undisturbed time on a
shared machine), and what the diloco step's compiled entry computation holds besides the inner
step (copies, broadcasts, loop fusions).

    python bench/diloco_step.py                    # four 1024x1024 matrices and biases, adam
    python bench/diloco_step.py --inner sgd --width 2048 --rounds 20 --hlo /tmp/diloco.hlo
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

import _common

_common.host_devices()  # before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm.costmodel import time_rounds  # noqa: E402

INNERS = {"adam": lambda: optax.adam(1e-3), "sgd": lambda: optax.sgd(1e-3)}


def model_params(width: int, layers: int):
    """`layers` (width x width) matrices and their biases, float32."""
    key = jax.random.key(0)
    params = {}
    for i in range(layers):
        params[f"w{i}"] = 1e-2 * jax.random.normal(jax.random.fold_in(key, i), (width, width))
        params[f"b{i}"] = jnp.zeros(width)
    return params


def rows_of(tree, n: int):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def build(name: str, inner, params, mesh):
    """A jitted step (params, state, grads) -> (params, state), its state and specs."""
    n = mesh.size
    if name == "local":
        state = (rows_of(params, n), rows_of(inner.init(params), n))
        specs = jax.tree.map(lambda _: P("data"), state)

        def step(p, s, g):
            local, inner_state = jax.tree.map(lambda x: x[0], s)
            u, inner_state = inner.update(jax.tree.map(lambda x: x[0], g), inner_state, local)
            local = optax.apply_updates(local, u)
            return p, jax.tree.map(lambda x: x[None], (local, inner_state))

    else:
        if name == "diloco":
            outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
            tx = jaxcomm.diloco(inner, outer, "data", sync_every=2**30)
        else:
            tx = optax.chain(jaxcomm.allreduce_gradients("data"), inner)
        with jax.set_mesh(mesh):
            state = tx.init(params)
        specs = jaxcomm.state_specs(state, "data")

        def step(p, s, g):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s

    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    return run, state


def entry_ops(hlo: str) -> dict[str, int]:
    """Copies, broadcasts and loop fusions of the compiled entry computation."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    return {
        op: len(re.findall(rf"\s{op}\(", entry))
        for op in ("copy", "broadcast", "fusion", "conditional")
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner", choices=sorted(INNERS), default="adam")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds")
    parser.add_argument("--hlo", metavar="PATH", help="write the diloco step's compiled HLO")
    args = parser.parse_args(argv)
    if jax.device_count() != 8:
        print(f"note: {jax.device_count()} devices (8 expected)", file=sys.stderr)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    params = model_params(args.width, args.layers)
    inner = INNERS[args.inner]()
    grads = jax.device_put(
        jax.tree.map(lambda x: 1e-3 * jnp.ones((mesh.size, *x.shape)), params),
        NamedSharding(mesh, P("data")),
    )
    elements = sum(x.size for x in jax.tree.leaves(params))
    print(f"{elements / 1e6:.1f} M params, inner {args.inner}, {mesh.size} devices")

    runs = {}
    for name in ("local", "diloco", "dense"):
        run, state = build(name, inner, params, mesh)
        p = jax.device_put(jax.tree.map(jnp.copy, params), NamedSharding(mesh, P()))
        compiled = run.lower(p, state, grads).compile()
        if name == "diloco":
            hlo = compiled.as_text()
            print("diloco entry computation:", entry_ops(hlo))
            if args.hlo:
                with open(args.hlo, "w") as f:
                    f.write(hlo)
        runs[name] = [run, *jax.block_until_ready(run(p, state, grads))]

    timed = time_rounds([_common.carried(c, grads) for c in runs.values()], reps=args.rounds)
    samples = dict(zip(runs, timed, strict=True))
    print(f"{'step':<8} {'median ms':>10} {'/ local':>8} {'min ms':>8} {'/ local':>8}")
    for name, times in samples.items():
        ratio = statistics.median(t / b for t, b in zip(times, samples["local"], strict=True))
        fastest = min(times) / min(samples["local"])
        print(
            f"{name:<8} {1e3 * statistics.median(times):>10.1f} {ratio:>8.2f} "
            f"{1e3 * min(times):>8.1f} {fastest:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
