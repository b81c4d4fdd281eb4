"""One rank of a replica group of several processes, for tests/test_ft_group.py.

Run under ``python -m jaxcomm.launch --replicas N -n M --devices-per-process D``:
DiLoCo (SGD inner, SGD(1) outer), or with ``--mode dp`` DataParallel (SGD,
bfloat16 between groups), on a linear model whose params are replicated
over the group's M * D devices and whose batch of 8 rows is split over them,
so that each inner step's gradient is summed across the group's processes.
Writes ``OUT/r{replica}-p{rank}-i{incarnation}.json``: the final params' bytes
and the rounds as this rank saw them. It stops at ``--rounds`` or later, at the first
committed round whose quorum holds every group. With ``--kill R:P:ROUND`` rank P of group
R kills itself (SIGKILL) in its first incarnation when its next round is ROUND.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal

import numpy as np

X = np.random.default_rng(1).normal(size=(24, 5))
Y = X @ np.arange(1.0, 6.0)
ROWS = 8


def batch(round_, step, index, count):
    """The group's batch: 8 rows chosen by the round, step and the group's shard."""
    rows = np.random.default_rng([round_, step, index, count]).choice(len(Y), ROWS, replace=False)
    return X[rows].astype(np.float32), Y[rows].astype(np.float32)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sync-every", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--kill", default=None)
    p.add_argument("--mode", choices=("diloco", "dp"), default="diloco")
    args = p.parse_args()

    import jaxcomm.distributed

    jaxcomm.distributed.initialize()

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomm import ft
    from jaxcomm.ft._trainer import host_leaves

    mesh = Mesh(np.array(jax.devices()), ("data",))

    def place(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    def loss(params, xy):
        x, y = xy
        return jnp.mean((x @ params["w"] - y) ** 2)

    rank, replica = jax.process_index(), int(os.environ["JAXCOMM_FT_REPLICA_ID"])
    incarnation = int(os.environ["JAXCOMM_FT_INCARNATION"])
    kill = None if args.kill is None else tuple(int(v) for v in args.kill.split(":"))
    group = ft.Group.from_env(timeout=10.0)
    if args.mode == "diloco":
        inner, outer = optax.sgd(args.lr), optax.sgd(1.0)
        trainer = ft.DiLoCo(group, loss, inner, outer, sync_every=args.sync_every)
    else:
        trainer = ft.DataParallel(group, loss, optax.sgd(args.lr), wire_dtype="bfloat16")
    x, y = batch(0, 0, 0, 1)  # compiles the step across the group's ranks before it joins
    state = trainer.start(
        {"w": place(np.zeros(5, np.float32), P())}, batch=(place(x, P("data")), place(y, P("data")))
    )
    everyone = int(os.environ["JAXCOMM_FT_REPLICAS"])
    # Until both the round count and a round with every group: a group left alone by a
    # dead peer trains on until the restarted one is back, so both stop at the same round.
    while state.round < args.rounds or len(trainer.log[-1].members) < everyone:
        if kill == (replica, rank, state.round + 1) and incarnation == 0 and state.step == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(state.round, state.step, *trainer.shard())
        state, value = trainer.step(state, (place(x, P("data")), place(y, P("data"))))
        jax.block_until_ready(value)  # one step in flight: XLA's CPU collectives need it
    (w,) = host_leaves(state.params)
    record = {
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "w": w.tobytes().hex(),
        "log": [
            [e.round, e.committed, list(e.members), e.healed, e.state_hash] for e in trainer.log
        ],
    }
    out = pathlib.Path(args.out) / f"r{replica}-p{rank}-i{incarnation}.json"
    out.write_text(json.dumps(record))
    group.close(finished=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
