"""examples/lm's byte transformer, trained by replica groups that may fail.

Run it under the launcher, which starts the lighthouse and the groups and
restarts a group that dies::

    python -m jaxcomm.launch --replicas 4 examples/fault_tolerance/train.py --rounds 30

Each group is one process with one CPU device, or (``-n M``) its own
``jax.distributed`` job of M processes: the params replicated over its devices,
each step's batch split over them, and rank 0 talking to the other groups.
``--mode diloco`` (default):
AdamW inner steps, a Nesterov outer step every ``--sync-every`` over the
groups of that round's quorum. ``--mode dp``: every step a round, the gradient
averaged over the groups in bfloat16. Kill a group (``kill -9``) and watch the
others go on and the launcher's replacement heal from them: docs/fault_tolerance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lm"))

import data  # noqa: E402  (examples/lm)
import jax  # noqa: E402
import model  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm.distributed  # noqa: E402
from jaxcomm import ft  # noqa: E402
from jaxcomm.ft import faults  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("diloco", "dp"), default="diloco")
    p.add_argument("--rounds", type=int, default=30, help="committed rounds to train")
    p.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H")
    p.add_argument("--batch", type=int, default=8, help="windows of 65 bytes per group and step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument(
        "--outer-lr",
        type=float,
        default=0.3,
        help="DiLoCo's outer Nesterov step; stable down to 2 groups (docs/fault_tolerance.md)",
    )
    p.add_argument(
        "--wire",
        default=None,
        help="float32 (default for diloco), bfloat16 (default for dp), float16",
    )
    p.add_argument(
        "--timeout", type=float, default=ft.replica.TIMEOUT_S, help="seconds a round may take"
    )
    p.add_argument("--host", default="127.0.0.1", help="address this group listens on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="rounds between validation losses (group 0 of the quorum)",
    )
    p.add_argument("--log", default=None, help="append one JSON line per round to this file")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.wire = {None: "bfloat16" if args.mode == "dp" else None, "float32": None}.get(
        args.wire, args.wire
    )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    jaxcomm.distributed.initialize()  # this group's own job (-n M); nothing for one process
    inject = faults.from_env() or (lambda phase, round_: None)
    corpus = data.load_corpus()
    net = model.ByteTransformer(rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(net, nnx.Param)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = jax.tree.map(lambda a: _place(np.asarray(a), mesh, P()), params)
    # Joined last: from its first heartbeat on, the other groups' quorums wait for this one.
    group = ft.Group.from_env(host=args.host, timeout=args.timeout, on_phase=inject)

    def loss_fn(params, windows):
        logits = nnx.merge(graphdef, params)(windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    if args.mode == "diloco":
        outer = optax.sgd(args.outer_lr, momentum=0.9, nesterov=True)
        trainer = ft.DiLoCo(
            group,
            loss_fn,
            optax.adamw(args.lr),
            outer,
            sync_every=args.sync_every,
            wire_dtype=args.wire,
        )
    else:
        trainer = ft.DataParallel(group, loss_fn, optax.adamw(args.lr), wire_dtype=args.wire)
    val = _place(data.fixed_windows(corpus.val, 256, 65), mesh, P("data"))
    evaluate = jax.jit(loss_fn)
    try:
        state = train(
            args, trainer, group, corpus, inject, lambda p: float(evaluate(p, val)), params, mesh
        )
    except ft.JobFinished as e:  # stopped or cut off while the others finished
        print(f"replica {group.replica_id}: {e}", flush=True)
        group.close()
        return 0
    final = float(evaluate(state.params, val))
    print(
        f"replica {group.replica_id}: {state.round} rounds committed, validation loss {final:.4f}",
        flush=True,
    )
    _log(args, group, None, final, key="final_loss", round=state.round)
    group.close(finished=True)
    return 0


def train(args, trainer, group, corpus, inject, evaluate, params, mesh):
    """The training loop: until ``args.rounds`` rounds are committed."""
    # Any batch of the steps' shape: the step compiles before this group joins, so
    # the other groups' next round does not wait for a restarted group's compilation.
    windows = data.sample_windows(corpus.train, args.batch, 65, np.random.default_rng(args.seed))
    state = trainer.start(params, batch=_place(windows, mesh, P("data")))
    logged = 0
    while state.round < args.rounds:
        index, count = trainer.shard()
        # The data follows the quorum: the windows depend on the round, the step
        # and this group's place in the last quorum.
        rng = np.random.default_rng([args.seed, state.round, state.step, index, count])
        if args.mode == "diloco" and state.step == args.sync_every // 2:
            inject("inner", state.round + 1)
        windows = _place(data.sample_windows(corpus.train, args.batch, 65, rng), mesh, P("data"))
        state, loss = trainer.step(state, windows)
        jax.block_until_ready(loss)  # one step in flight: XLA's CPU collectives need it
        for entry in trainer.log[logged:]:
            _log(args, group, entry, float(loss))
            first = trainer.shard()[0] == 0
            if args.eval_every and entry.committed and entry.round % args.eval_every == 0 and first:
                val = evaluate(state.params)
                _log(args, group, None, val, key="eval_loss", round=entry.round)
        logged = len(trainer.log)
    return state


def _place(a: np.ndarray, mesh, spec) -> jax.Array:
    """A host array that every process of the group holds, as one array over the group."""
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def _log(args, group, entry, loss, *, key=None, round=None):
    line = {
        "replica": group.replica_id,
        "incarnation": int(os.environ.get("JAXCOMM_FT_INCARNATION", 0)),
    }
    if entry is None:
        line.update({key: loss, "round": round, "time": time.time()})
    else:
        line.update(entry._asdict(), train_loss=loss)
        if not entry.committed:
            print(f"round {entry.round + 1} aborted: {entry.reason}", flush=True)
    if args.log and jax.process_index() == 0:  # one line per group, from its rank 0
        with open(args.log, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
