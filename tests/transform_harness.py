"""Running an optax transformation for several steps on every device of a
mesh, with per-device gradients, and collecting what each device holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _rows(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _unrow(tree):
    return jax.tree.map(lambda x: x[0], tree)


def random_grads(rng, shapes: dict, n_devices: int, steps: int, scale=1.0) -> list:
    """steps x {name: float32 array of shape (n_devices, *shape)}."""
    return [
        {
            k: (scale * rng.standard_normal((n_devices, *s))).astype(np.float32)
            for k, s in shapes.items()
        }
        for _ in range(steps)
    ]


def run_steps(tx, params, grads_seq, mesh, *, check_vma: bool = True):
    """Runs `tx` for len(grads_seq) steps on every device of `mesh`.

    Every array carries one leading row per device (state and params too, so
    that per-device differences would show), so all of them are typed as
    varying; check_vma=False lifts that for transforms (like
    optax.apply_if_finite) that need replicated types. Each step is waited for: XLA's
    CPU collectives must not have two steps in flight.

    Returns:
      (updates per step, final params, final state), as NumPy arrays with a
      leading device axis.
    """
    spec = P(tuple(mesh.axis_names))
    n = mesh.size
    put = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec)), tree
    )

    def init(p):
        return _rows(tx.init(_unrow(p)))

    def step(p, state, g):
        p, state, g = _unrow(p), _unrow(state), _unrow(g)
        updates, state = tx.update(g, state, p)
        return _rows(optax.apply_updates(p, updates)), _rows(state), _rows(updates)

    def shard(f):
        return jax.jit(
            jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma)
        )

    p = put(jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), params))
    state = jax.block_until_ready(shard(init)(p))
    run = shard(step)
    updates = []
    for g in grads_seq:
        p, state, u = jax.block_until_ready(run(p, state, put(g)))
        updates.append(jax.tree.map(np.asarray, u))
    return updates, jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, state)


def optax_on_mean(tx, params, grads_seq):
    """The reference: plain optax on one device, fed the float64 mean of the
    per-device gradients (cast to float32)."""
    state = tx.init(params)
    p = params
    for g in grads_seq:
        mean = {k: v.astype(np.float64).mean(0).astype(np.float32) for k, v in g.items()}
        u, state = tx.update(mean, state, p)
        p = optax.apply_updates(p, u)
    return jax.tree.map(np.asarray, p), state


def assert_same_on_all_devices(tree, what: str):
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        x = np.ascontiguousarray(x)
        for d in range(1, x.shape[0]):
            assert x[d].tobytes() == x[0].tobytes(), (
                f"{what}{jax.tree_util.keystr(path)} differs between device 0 and {d}"
            )
