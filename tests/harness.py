"""Running code on the 8 CPU devices and checking what each device holds.

Three levels: a per-device function on a mesh (``run_sharded``,
``sharded_runner``, ``run_pmap``); an optax transformation for several steps
(``run_steps``, against the ``optax_on_mean`` reference); and the step as the
README writes it (``user_step``, ``run_as_users_do``: params replicated, the
state carried by ``jaxcomm.state_specs``). Every array carries one leading
row per device, so that per-device differences show;
``assert_same_on_all_devices`` checks the rows bitwise. Each step is waited
for: XLA's CPU collectives must not have two steps in flight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm


def mesh_of(shape: tuple, names: tuple):
    """A mesh of the first prod(shape) devices."""
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def _rows(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _unrow(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _put_rows(tree, mesh):
    """Places every array's leading axis (one row per device) over all of `mesh`."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), sharding), tree)


def _sharded(fn, mesh, *, jit: bool = True, check_vma: bool = True):
    """`fn` over blocks of one row per device, under shard_map on `mesh`."""
    spec = P(tuple(mesh.axis_names))
    f = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma)
    return jax.jit(f) if jit else f


def _to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def run_sharded(fn, mesh, *per_device, jit: bool = True):
    """Runs fn(*rows) on every device of `mesh`; each array in `per_device`
    has one leading row per device (in linear mesh order). Returns numpy
    arrays with one leading row per device."""
    return sharded_runner(fn, mesh, jit=jit)(*per_device)


def run_pmap(fn, n: int, *per_device, axis_name="i"):
    """fn under jax.pmap on the first `n` devices; numpy results, one row per device."""
    f = jax.pmap(fn, axis_name=axis_name, devices=jax.devices()[:n])
    return _to_numpy(jax.block_until_ready(f(*per_device)))


def random_grads(rng, shapes: dict, n_devices: int, steps: int, scale=1.0) -> list:
    """steps x {name: float32 array of shape (n_devices, *shape)}."""
    return [
        {
            k: (scale * rng.standard_normal((n_devices, *s))).astype(np.float32)
            for k, s in shapes.items()
        }
        for _ in range(steps)
    ]


def regression_data(rng, steps, devices, batch, features, *, shared_inputs=False):
    """Per step and device a batch of a linear regression, float32 ``x`` of
    shape (steps, devices, batch, features) and ``y`` (steps, devices, batch);
    each device's targets come from its own weights and bias. With
    ``shared_inputs`` every device sees the same x."""
    truth = rng.standard_normal((devices, features + 1))
    x = rng.standard_normal((steps, 1 if shared_inputs else devices, batch, features))
    x = np.broadcast_to(x, (steps, devices, batch, features)).astype(np.float32)
    y = np.einsum("sdbf,df->sdb", x, truth[:, :-1]) + truth[:, -1][None, :, None]
    return x, y.astype(np.float32)


def run_steps(tx, params, grads_seq, mesh, *, check_vma: bool = True, each_step=None):
    """Runs `tx` for len(grads_seq) steps on every device of `mesh`.

    Every array carries one leading row per device (state and params too, so
    that per-device differences would show), so all of them are typed as
    varying; check_vma=False lifts that for transforms (like
    optax.apply_if_finite) that need replicated types. ``each_step``, if
    given, is called with the params and the state (NumPy) after every step.

    Returns:
      (updates per step, final params, final state), as NumPy arrays with a
      leading device axis.
    """
    n = mesh.size

    def init(p):
        return _rows(tx.init(_unrow(p)))

    def step(p, state, g):
        p, state, g = _unrow(p), _unrow(state), _unrow(g)
        updates, state = tx.update(g, state, p)
        return _rows(optax.apply_updates(p, updates)), _rows(state), _rows(updates)

    p = _put_rows(jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), params), mesh)
    state = jax.block_until_ready(_sharded(init, mesh, check_vma=check_vma)(p))
    run = _sharded(step, mesh, check_vma=check_vma)
    updates = []
    for g in grads_seq:
        p, state, u = jax.block_until_ready(run(p, state, _put_rows(g, mesh)))
        updates.append(_to_numpy(u))
        if each_step is not None:
            each_step(_to_numpy(p), _to_numpy(state))
    return updates, _to_numpy(p), _to_numpy(state)


def optax_on_mean(tx, params, grads_seq):
    """The reference: plain optax on one device, fed the float64 mean of the
    per-device gradients (cast to float32)."""
    state = tx.init(params)
    p = params
    for g in grads_seq:
        mean = {k: v.astype(np.float64).mean(0).astype(np.float32) for k, v in g.items()}
        u, state = tx.update(mean, state, p)
        p = optax.apply_updates(p, u)
    return _to_numpy(p), state


def assert_same_on_all_devices(tree, what: str = "result"):
    """Every leaf's rows (one per device) are bitwise equal; a leaf may be one array."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        x = np.ascontiguousarray(x)
        for d in range(1, x.shape[0]):
            assert x[d].tobytes() == x[0].tobytes(), (
                f"{what}{jax.tree_util.keystr(path)} differs between device 0 and {d}"
            )


def sharded_runner(fn, mesh, *, jit: bool = True):
    """``run_sharded`` built once: the returned function runs fn on every
    device of `mesh` for the per-device arrays it is given, as often as
    needed, compiling once per distinct shape and dtype instead of once
    per call."""

    def body(*blocks):
        return _rows(fn(*_unrow(blocks)))

    f = _sharded(body, mesh, jit=jit)

    def run(*per_device):
        args = _put_rows([jnp.asarray(a) for a in per_device], mesh)
        return _to_numpy(jax.block_until_ready(f(*args)))

    return run


def user_step(tx, mesh, state, axis="data"):
    """The README's step for `tx`, jitted over shard_map on `mesh`: params
    replicated (P()), the state carried by ``jaxcomm.state_specs``, and
    each device's own gradient (one row per device, split over `axis`).

    Returns:
      (step(params, state, grads) -> (params, state, updates), the specs).
    """
    specs = jaxcomm.state_specs(state, axis)

    def step(params, state, g):
        g = jax.tree.map(lambda x: x[0], g)  # this device's row
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, updates

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(axis)), out_specs=(P(), specs, P()))
    )
    return run, specs


def run_as_users_do(
    tx, params, grads_seq, mesh, *, axis="data", init_in_shard_map=False, each_step=None
):
    """Runs `tx` for len(grads_seq) steps of ``user_step``; each gradient
    leaf has one row per device.

    The state is built by ``tx.init`` under the mesh and placed by its specs,
    as the README does; with ``init_in_shard_map``, inside shard_map (a
    per-device leaf without a device axis of its own, like MultiSteps'
    accumulator, is then one block per device). ``each_step(params, state,
    updates)``, if given, is called after every step with the device arrays.

    Returns:
      (updates per step as NumPy, final params as NumPy, final state).
    """
    if init_in_shard_map:
        with jax.set_mesh(mesh):
            specs = jaxcomm.state_specs(jax.eval_shape(tx.init, params), axis)
        init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
        state = jax.jit(init)(params)
    else:
        with jax.set_mesh(mesh):
            state = tx.init(params)
    run, specs = user_step(tx, mesh, state, axis)
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    rows = NamedSharding(mesh, P(axis))
    updates = []
    for g in grads_seq:
        p, state, u = jax.block_until_ready(run(p, state, jax.device_put(g, rows)))
        updates.append(_to_numpy(u))
        if each_step is not None:
            each_step(p, state, u)
    return updates, _to_numpy(p), state


# The nonce another job drew: added to a handle, it names an exchange this
# job never started (a state restored by a new process).
OTHER_JOB = np.array([1, 0, 0], np.int32)


def update_step(tx, params, mesh, axis="data"):
    """(run, state): ``tx.update`` on each device's row of the gradients,
    jitted under shard_map, the state initialised from `params` and placed
    as :func:`jaxcomm.state_specs` says (how a user carries it). ``run(state,
    grads)`` returns (update, state)."""
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, axis)

    def step(state, g):
        return tx.update(jax.tree.map(lambda x: x[0], g), state)

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(P(), specs)))
    return run, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def run_updates(tx, params, grads_seq, mesh, *, before_step=None, axis="data"):
    """Runs :func:`update_step` on each step's grads (one row per device),
    one step in flight. ``before_step(t, state)`` may replace the state
    before step t. Returns the updates and the states (NumPy) and, after each
    step, how many more started allreduces are in flight than before."""
    from jaxcomm import _ffi

    run, state = update_step(tx, params, mesh, axis)
    updates, states, in_flight, before = [], [], [], _ffi.in_flight()
    for t, g in enumerate(grads_seq):
        if before_step is not None:
            state = before_step(t, state)
        u, state = jax.block_until_ready(
            run(state, jax.device_put(g, NamedSharding(mesh, P(axis))))
        )
        updates.append(_to_numpy(u))
        states.append(_to_numpy(state))
        in_flight.append(_ffi.in_flight() - before)
    return updates, states, in_flight
