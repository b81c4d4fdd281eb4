"""diloco against a NumPy float64 DiLoCo written here from the papers, step by step.

Each of the 8 devices fits a linear regression to its own data (a different
target per device), so the local trajectories really diverge between syncs.
The reference keeps every device's params, inner optimizer state and the
per-fragment outer states in float64 and is compared with the jitted
shard_map step after every step: the global params, every device's local
params, and the stats. Also: replicas bitwise equal right after a sync and
different between syncs, collectives only inside the sync branch of the HLO,
bad options named at construction, and an Orbax checkpoint resumed mid-cycle.
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._sync_schedule import applies, syncs
from jaxcomm.collectives import _peers
from jaxcomm.transforms.diloco import plan_fragments, sync_offsets
from tests import hlo
from tests.harness import mesh_of, regression_data
from tests.reference import Adam as NpAdam
from tests.reference import Sgd as NpSgd

N = 8
SHAPES = {"bias": (), "w_a": (5,), "w_b": (2, 4), "w_c": (7,)}  # tree order: sorted keys
NAMES = list(SHAPES)
FEATURES, BATCH = 5 + 8 + 7, 6
STEPS = 24
# Written out by hand for these shapes (21 elements: 1, 5, 8, 7).
FRAGMENTS = {1: [NAMES], 3: [["bias", "w_a"], ["w_b"], ["w_c"]]}
# (sync_every, fragments) -> (step + 1) % H at which each fragment syncs.
OFFSETS = {(4, 1): [0], (6, 3): [2, 4, 0]}
INNER_LR, OUTER_LR, OUTER_MOMENTUM = 0.05, 0.7, 0.9


# -- the problem ------------------------------------------------------------


def _data(steps: int, seed: int = 0):
    return regression_data(np.random.default_rng(seed), steps, N, BATCH, FEATURES)


def _initial_params():
    rng = np.random.default_rng(7)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _loss(p, x, y):
    w = jnp.concatenate([p["w_a"], p["w_b"].reshape(-1), p["w_c"]])
    return 0.5 * jnp.mean((x @ w + p["bias"] - y) ** 2)


def _np_grad(p, x, y):
    """The gradient of _loss in float64, by hand."""
    w = np.concatenate([p["w_a"], p["w_b"].reshape(-1), p["w_c"]])
    r = x @ w + p["bias"] - y
    gw = x.T @ r / len(y)
    return {"bias": r.mean(), "w_a": gw[:5], "w_b": gw[5:13].reshape(2, 4), "w_c": gw[13:]}


# -- the reference optimizers (optax's definitions, in float64) -------------


class NpNesterov:
    def init(self, keys):
        return {k: np.zeros(SHAPES[k]) for k in keys}

    def update(self, g, trace):
        trace = {k: g[k] + OUTER_MOMENTUM * trace[k] for k in g}
        return {k: -OUTER_LR * (g[k] + OUTER_MOMENTUM * trace[k]) for k in g}, trace


def reference(inner, params, x, y, *, sync_every, fragments, delay=0, mixing=0.0):
    """DiLoCo in float64: per step, (global params, per-device local params,
    names whose outer update landed this step, names synced this step).

    A fragment's average is taken at its sync and its outer step lands
    ``delay`` steps later, each device then keeping ``mixing`` of its own
    params (Streaming DiLoCo's tau and alpha)."""
    groups, offsets = FRAGMENTS[fragments], OFFSETS[sync_every, fragments]
    glob = {k: v.astype(np.float64) for k, v in params.items()}
    local = [dict(glob) for _ in range(N)]
    inner_states = [inner.init(SHAPES) for _ in range(N)]
    outer = NpNesterov()
    outer_states = [outer.init(names) for names in groups]
    pending, synced_at = [None] * len(groups), [None] * len(groups)
    out = []
    for s in range(len(x)):
        for d in range(N):
            g = _np_grad(local[d], x[s, d].astype(np.float64), y[s, d].astype(np.float64))
            u, inner_states[d] = inner.update(g, inner_states[d])
            local[d] = {k: local[d][k] + u[k] for k in NAMES}
        sent, landed = [], []
        for f, names in enumerate(groups):
            if (s + 1) % sync_every == offsets[f]:
                pending[f] = {
                    k: np.mean([glob[k] - local[d][k] for d in range(N)], axis=0) for k in names
                }
                synced_at[f] = s
                sent += names
        for f, names in enumerate(groups):
            if synced_at[f] is None or s != synced_at[f] + delay:
                continue
            u, outer_states[f] = outer.update(pending[f], outer_states[f])
            glob = {**glob, **{k: glob[k] + u[k] for k in names}}
            local = [
                {**local[d], **{k: mixing * local[d][k] + (1 - mixing) * glob[k] for k in names}}
                for d in range(N)
            ]
            landed += names
        out.append((glob, [dict(p) for p in local], landed, sent))
    return out


# -- running the transform --------------------------------------------------


def _mesh():
    return mesh_of((N,), ("data",))


def _put(tree, mesh, specs):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def _runner(tx, mesh, state):
    """The user's step, as the docstring shows it, jitted."""
    specs = jaxcomm.state_specs(state, "data")

    def step(params, state, x, y):
        grads = jax.grad(_loss)(jaxcomm.local_params(state), x[0], y[0])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    data = P("data")
    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, data, data), out_specs=(P(), specs))
    ), specs


def _start(tx, mesh, params):
    with jax.set_mesh(mesh):
        state = tx.init(params)
    run, specs = _runner(tx, mesh, state)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    return run, params, _put(state, mesh, specs)


_DEFAULTS = {"bucket_bytes": None, "delay": 0, "mixing": 0.0}


@functools.cache
def _shared_runner(inner: str, options: frozenset):
    tx = _diloco(getattr(optax, inner)(INNER_LR), **dict(options))
    with jax.set_mesh(_mesh()):
        state = tx.init(_initial_params())
    return tx, _runner(tx, _mesh(), state)[0]


def _start_shared(inner: str, **options):
    """_start for _diloco(optax.<inner>(INNER_LR), **options) on _initial_params,
    with one jitted step per distinct program: the tests that run it and
    the ones that read its HLO share its compile."""
    options = {k: v for k, v in options.items() if k not in _DEFAULTS or v != _DEFAULTS[k]}
    tx, run = _shared_runner(inner, frozenset(options.items()))
    _, params, state = _start(tx, _mesh(), _initial_params())
    return run, params, state


def _steps(run, params, state, x, y, mesh):
    """Runs every step (one in flight at a time); per step, NumPy (params, state)."""
    rows = NamedSharding(mesh, P("data"))
    out = []
    for s in range(len(x)):
        xs, ys = jax.device_put(x[s], rows), jax.device_put(y[s], rows)
        params, state = jax.block_until_ready(run(params, state, xs, ys))
        out.append(jax.tree.map(np.asarray, (params, state)))
    return out, params, state


def _ffi_module():
    from jaxcomm import _ffi

    return _ffi


def _diloco(inner, **options):
    outer = optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return jaxcomm.diloco(inner, outer, "data", **options)


# -- against the reference --------------------------------------------------

# name -> (inner optax optimizer, its reference, sync_every, fragments, options,
# collectives per sync: "leaf" one per leaf synced, else that number).
CASES = {
    "adam_xla": ("adam", NpAdam(INNER_LR), 4, 1, {"backend": "xla"}, "leaf"),
    # One 4 MiB bucket.
    "sgd_ffi": ("sgd", NpSgd(INNER_LR), 4, 1, {"backend": "ffi"}, 1),
    "streaming_adam_xla_fused": (
        "adam",
        NpAdam(INNER_LR),
        6,
        3,
        {"backend": "xla", "bucket_bytes": math.inf},
        1,
    ),
    "streaming_sgd_ffi_unfused": (
        "sgd",
        NpSgd(INNER_LR),
        6,
        3,
        {"backend": "ffi", "bucket_bytes": 0},
        "leaf",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_float64_reference_step_by_step(case):
    inner, np_inner, sync_every, fragments, options, per_sync = CASES[case]
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(STEPS)
    run, p, state = _start_shared(inner, sync_every=sync_every, fragments=fragments, **options)
    got, _, _ = _steps(run, p, state, x, y, mesh)
    want = reference(np_inner, params, x, y, sync_every=sync_every, fragments=fragments)
    total = sum(int(np.prod(s)) for s in SHAPES.values())
    syncs = 0
    for s, ((gp, gs), (wp, wlocal, synced, _)) in enumerate(zip(got, want, strict=True)):
        for k in NAMES:
            np.testing.assert_allclose(gp[k], wp[k], rtol=2e-4, atol=2e-5, err_msg=f"{k} {s}")
            rows = gs.local.value[k]
            for d in range(N):
                np.testing.assert_allclose(
                    rows[d], wlocal[d][k], rtol=2e-4, atol=2e-5, err_msg=f"local {k} {s} {d}"
                )
            if k in synced:  # every device adopted the global params, bitwise
                assert all(rows[d].tobytes() == gp[k].tobytes() for d in range(N)), (k, s)
            else:  # each device went its own way since this leaf's last sync
                assert any(rows[d].tobytes() != rows[0].tobytes() for d in range(N)), (k, s)
                if s:  # and the global params did not move
                    assert gp[k].tobytes() == got[s - 1][0][k].tobytes(), (k, s)
        stats = jaxcomm.get_stats(gs)
        elements = sum(int(np.prod(SHAPES[k])) for k in synced)
        collectives = len(synced) if per_sync == "leaf" else per_sync * bool(synced)
        assert int(stats.collectives) == collectives, s
        assert float(stats.payload_bytes) == 4 * elements, s
        np.testing.assert_allclose(float(stats.bytes_sent), 4 * elements * 2 * (N - 1) / N)
        np.testing.assert_allclose(float(stats.density), elements / total, rtol=1e-6)
        assert not bool(stats.nonfinite)
        assert int(gs.count) == s + 1
        syncs += bool(synced)
    assert syncs == STEPS * fragments // sync_every


# (sync_every, fragments, delay tau, mixing alpha): tau = 3 on (6, 3) keeps two
# fragments in flight at once.
DELAYED = [
    (4, 1, 0, 0.5),
    (4, 1, 1, 0.0),
    (4, 1, 2, 0.25),
    (4, 1, 3, 0.0),
    (6, 3, 1, 0.5),
    (6, 3, 2, 0.0),
    (6, 3, 3, 0.25),
]


# backend="xla" runs a delayed sync's collective in its sync step; "auto" on
# CPU starts it there and finishes it in the landing step (jaxcomm's transport).
DELAYED_RUNS = [(*case, "xla") for case in DELAYED] + [
    (*case, "auto") for case in DELAYED if case[2] >= 2
]


@pytest.mark.parametrize(("sync_every", "fragments", "delay", "mixing", "backend"), DELAYED_RUNS)
def test_delay_and_mixing_match_the_float64_reference(
    sync_every, fragments, delay, mixing, backend
):
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(STEPS)
    tx = _diloco(
        optax.adam(INNER_LR),
        sync_every=sync_every,
        fragments=fragments,
        delay=delay,
        mixing=mixing,
        backend=backend,
    )
    overlapped = backend == "auto"
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")

    def step(params, state, x, y):
        grads = jax.grad(_loss)(jaxcomm.local_params(state), x[0], y[0])
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return params, state, jaxcomm.check_replicas((params, state.pending), "data")

    data = P("data")
    run = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, data, data), out_specs=(P(), specs, P())
        )
    )
    p, state = jax.device_put(params, NamedSharding(mesh, P())), _put(state, mesh, specs)
    want = reference(
        NpAdam(INNER_LR),
        params,
        x,
        y,
        sync_every=sync_every,
        fragments=fragments,
        delay=delay,
        mixing=mixing,
    )
    rows_of = NamedSharding(mesh, data)
    landings, previous, in_flight = 0, None, _ffi_module().in_flight()
    for s, (wp, wlocal, landed, sent) in enumerate(want):
        xs, ys = jax.device_put(x[s], rows_of), jax.device_put(y[s], rows_of)
        p, state, diff = jax.block_until_ready(run(p, state, xs, ys))
        gp, gs = jax.tree.map(np.asarray, (p, state))
        assert int(diff.worst()[1]) == 0, s  # global params and pending: bitwise replicas
        for k in NAMES:
            np.testing.assert_allclose(gp[k], wp[k], rtol=2e-4, atol=2e-5, err_msg=f"{k} {s}")
            rows = gs.local.value[k]
            for d in range(N):
                np.testing.assert_allclose(
                    rows[d], wlocal[d][k], rtol=2e-4, atol=2e-5, err_msg=f"local {k} {s} {d}"
                )
            if k in landed and not mixing:  # every device adopted the global params, bitwise
                assert all(rows[d].tobytes() == gp[k].tobytes() for d in range(N)), (k, s)
            if k not in landed and previous is not None:  # the global params did not move
                assert gp[k].tobytes() == previous[k].tobytes(), (k, s)
        stats = jaxcomm.get_stats(gs)
        elements = sum(int(np.prod(SHAPES[k])) for k in sent)
        # xla: one per leaf; started: one per fragment (its leaves share a dtype).
        assert int(stats.collectives) == (bool(sent) if overlapped else len(sent)), s
        assert float(stats.payload_bytes) == 4 * elements, s
        assert len(gs.pending) == (fragments if delay else 0)
        if overlapped:  # started at the sync, still in flight until it lands
            in_flight += N * (bool(sent) - bool(landed))
            assert _ffi_module().in_flight() == in_flight, s
        landings += bool(landed)
        previous = gp
    syncs = STEPS * fragments // sync_every
    assert landings == syncs - sum(  # the syncs whose tau steps run past the end
        1
        for f in range(fragments)
        for s in range(STEPS)
        if (s + 1) % sync_every == OFFSETS[sync_every, fragments][f] and s + delay >= STEPS
    )


def test_plan_fragments_cuts_at_the_nearest_boundary():
    assert plan_fragments([1, 5, 8, 7], 1) == ((0, 4),)
    assert plan_fragments([1, 5, 8, 7], 3) == ((0, 2), (2, 3), (3, 4))
    assert plan_fragments([10, 1, 1, 10], 2) == ((0, 2), (2, 4))  # 11 of 22
    assert plan_fragments([3, 2, 3], 2) == ((0, 1), (1, 3))  # 3 and 5 tie around 4
    assert plan_fragments([100, 1, 1], 3) == ((0, 1), (1, 2), (2, 3))  # one leaf each at least
    assert plan_fragments([0, 6, 0, 6], 2) == ((0, 2), (2, 4))
    with pytest.raises(ValueError, match="fragments=3"):
        plan_fragments([4, 4], 3)


def test_sync_offsets_follow_the_schedule():
    for (h, f), offsets in OFFSETS.items():
        assert list(sync_offsets(h, f)) == offsets
    assert sync_offsets(8, 4) == (2, 4, 6, 0)
    assert sync_offsets(1, 1) == (0,)


def test_an_outer_update_lands_delay_steps_after_its_sync():
    for h, f, tau, _ in DELAYED:
        for offset in sync_offsets(h, f):
            sent = [s for s in range(40) if syncs(s, offset, h)]
            landed = [s for s in range(40) if applies(s, offset, h, tau)]
            assert landed == [s + tau for s in sent if s + tau < 40], (h, f, tau, offset)


def test_narrow_wire_halves_the_payload_and_keeps_replicas_equal():
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(8)
    runs = {}
    for wire in (None, jnp.bfloat16):
        tx = _diloco(optax.adam(INNER_LR), sync_every=4, wire_dtype=wire)
        run, p, state = _start(tx, mesh, params)
        runs[wire], _, _ = _steps(run, p, state, x, y, mesh)
    for s in (3, 7):
        (p16, st16), (p32, _) = runs[jnp.bfloat16][s], runs[None][s]
        assert float(jaxcomm.get_stats(st16).payload_bytes) == 2 * 21
        for k in NAMES:
            rows = st16.local.value[k]
            assert all(rows[d].tobytes() == p16[k].tobytes() for d in range(N))
            np.testing.assert_allclose(p16[k], p32[k], rtol=3e-2, atol=3e-3)


def _run_simple(tx, mesh, axes, params, grads):
    """Steps with given per-device gradients (rows), taken as if at the local params."""
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, axes)

    def step(params, state, g):
        updates, state = tx.update(jax.tree.map(lambda x: x[0], g), state, params)
        return optax.apply_updates(params, updates), state

    rows = P(axes)
    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, rows), out_specs=(P(), specs))
    )
    state = _put(state, mesh, specs)
    out = []
    for g in grads:
        g = jax.device_put(g, NamedSharding(mesh, rows))
        params, state = jax.block_until_ready(run(params, state, g))
        out.append(jax.tree.map(np.asarray, (params, state)))
    return out


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_error_feedback_sends_what_the_wire_dropped_next_time(backend):
    """Hand-worked in exact binary fractions: each device's pseudo-gradient is
    1 + 3 * 2^-9 per step (a bfloat16 has 8 significant bits: it rounds to
    1 + 2^-7, dropping -2^-9; then the residual makes 1 + 2^-8, a tie that
    rounds to 1, dropping 2^-8; then 1 + 5 * 2^-9, dropping 2^-9), prescaled
    by 1/8; SGD(1) inside and outside, a sync every step. Alike on every
    device so that any adder sums the wire values exactly. The reference
    replays cast, mean and residual in NumPy with ml_dtypes."""
    mesh = _mesh()
    g = np.full((N, 4), 1 + 3 * 2.0**-9, np.float32)
    grads = [{"w": g}] * 3
    kept, runs = {}, {}
    for ef in (False, True):
        tx = jaxcomm.diloco(
            optax.sgd(1.0),
            optax.sgd(1.0),
            "data",
            sync_every=1,
            wire_dtype=jnp.bfloat16,
            error_feedback=ef,
            backend=backend,
        )
        runs[ef] = _run_simple(tx, mesh, "data", {"w": jnp.zeros(4)}, grads)
    for ef in (False, True):
        w, e = np.zeros(4), np.zeros((N, 4))
        for step in grads:
            sent = step["w"].astype(np.float64) + (e if ef else 0)
            wire = (sent / N).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
            e = sent - N * wire
            w = w - wire.sum(axis=0)
            got_params, got_state = runs[ef][len(kept.get(ef, []))]
            kept.setdefault(ef, []).append(w)
            np.testing.assert_array_equal(got_params["w"], w.astype(np.float32))
            if ef:
                np.testing.assert_array_equal(got_state.error.value[0][0], e.astype(np.float32))
        if ef:  # what was applied is what was sent, less what is still kept
            np.testing.assert_array_equal(-w, g.astype(np.float64).mean(0) * 3 - e.mean(0))
    assert not np.array_equal(kept[True][-1], kept[False][-1])  # without it, 2^-9s are lost
    assert runs[False][0][1].error.value == ()


def test_error_feedback_overlapped_equals_it_in_the_sync_step():
    """The started exchange sends and keeps what the in-step one does."""
    mesh = _mesh()
    g = np.full((N, 4), 1 + 3 * 2.0**-9, np.float32)
    finals = []
    for backend in ("xla", "auto"):  # in the sync step; started there, finished a step later
        tx = jaxcomm.diloco(
            optax.sgd(1.0),
            optax.sgd(1.0),
            "data",
            sync_every=2,
            delay=1,
            wire_dtype=jnp.bfloat16,
            error_feedback=True,
            backend=backend,
        )
        out = _run_simple(tx, mesh, "data", {"w": jnp.zeros(4)}, [{"w": g}] * 8)
        finals.append((out[-1][0]["w"], out[-1][1].error.value[0][0]))
    assert finals[0][0].tobytes() == finals[1][0].tobytes()
    assert finals[0][1].tobytes() == finals[1][1].tobytes()
    assert np.abs(finals[0][1]).max() > 0  # something was dropped and kept


def test_one_collective_per_dtype_on_hierarchical_axes():
    mesh = mesh_of((2, 4), ("node", "local"))
    axes = ("node", "local")
    params = {"a": jnp.ones(4, jnp.float32), "b": jnp.ones(3, jnp.bfloat16)}
    rng = np.random.default_rng(3)
    grads = [
        {
            "a": rng.standard_normal((N, 4)).astype(np.float32),
            "b": rng.standard_normal((N, 3)).astype(jnp.bfloat16),
        }
        for _ in range(4)
    ]
    tx = jaxcomm.diloco(
        optax.sgd(INNER_LR), optax.sgd(1.0), axes, sync_every=2, algorithm="hierarchical"
    )
    out = _run_simple(tx, mesh, axes, params, grads)
    for s, (p, state) in enumerate(out):
        stats = jaxcomm.get_stats(state)
        assert int(stats.collectives) == (2 if s % 2 else 0)
        assert float(stats.payload_bytes) == (4 * 4 + 3 * 2 if s % 2 else 0)
        if s % 2:  # outer sgd(1.0) on the mean pseudo-gradient: the mean of the local params
            for k in p:
                rows = state.local.value[k]
                assert all(r.tobytes() == p[k].tobytes() for r in rows), (k, s)
            mean = np.mean([g["a"].astype(np.float64) for g in grads[s - 1 : s + 1]], axis=(0, 1))
            want = out[s - 2][0]["a"] if s > 1 else np.ones(4)
            np.testing.assert_allclose(p["a"], want - 2 * INNER_LR * mean, rtol=1e-5)


def test_under_pmap_as_under_shard_map():
    params = _initial_params()
    x, y = _data(4)
    tx = _diloco(optax.adam(INNER_LR), sync_every=2, fragments=2)
    mesh = _mesh()
    run, p, state = _start(tx, mesh, params)
    _, want_params, want_state = _steps(run, p, state, x, y, mesh)

    def init(p):
        return tx.init(p)

    def step(params, state, x, y):
        grads = jax.grad(_loss)(jaxcomm.local_params(state), x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    p = jax.tree.map(lambda v: np.broadcast_to(v, (N, *np.shape(v))), params)
    state = jax.pmap(init, axis_name="data")(p)
    run = jax.pmap(step, axis_name="data")
    for s in range(len(x)):
        p, state = jax.block_until_ready(run(p, state, x[s], y[s]))
    for k in NAMES:
        got = np.asarray(p[k])
        assert all(got[d].tobytes() == got[0].tobytes() for d in range(N)), k
        np.testing.assert_allclose(got[0], np.asarray(want_params[k]), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(
            np.asarray(state.local.value[k])[:, 0],
            np.asarray(want_state.local.value[k]),
            rtol=1e-6,
            atol=1e-7,
        )


def test_a_nonfinite_pseudo_gradient_is_flagged_on_every_device():
    mesh = _mesh()
    grads = [{"w": np.ones((N, 3), np.float32)} for _ in range(4)]
    grads[2]["w"][5, 1] = np.nan  # one device, between syncs
    tx = _diloco(optax.sgd(INNER_LR), sync_every=2)
    out = _run_simple(tx, mesh, "data", {"w": jnp.zeros(3)}, grads)
    assert [bool(jaxcomm.get_stats(st).nonfinite) for _, st in out] == [False] * 3 + [True]


# -- where the collectives are ----------------------------------------------


def _communicating(program: hlo.Program, name: str) -> int:
    """What communicates in computation `name` and what it runs, branches
    too (jaxcomm_pool and jaxcomm_after are local: they copy or wait)."""
    return sum(bool(i.collective) for i in program.walk(name))


def _per_branch(program: hlo.Program, count) -> list[list[int]]:
    """Per conditional, count(branch) for each of its branches, sorted."""
    return [sorted(count(b) for b in c.branches) for c in hlo.conditionals(program)]


@pytest.mark.parametrize(
    ("sync_every", "fragments", "backend", "bucket_bytes", "delay"),
    [
        (4, 1, "xla", None, 0),  # CASES["adam_xla"]'s program
        (6, 3, "xla", math.inf, 0),  # CASES["streaming_adam_xla_fused"]'s
        (6, 3, "ffi", None, 0),
        (6, 3, "xla", math.inf, 1),
    ],
)
def test_collectives_only_inside_the_sync_branch(
    sync_every, fragments, backend, bucket_bytes, delay
):
    """With a delay too: the collective in the sync's cond, none in the landing's."""
    mesh = _mesh()
    run, p, state = _start_shared(
        "adam",
        sync_every=sync_every,
        fragments=fragments,
        backend=backend,
        bucket_bytes=bucket_bytes,
        delay=delay,
        mixing=0.5 if delay else 0.0,
    )
    x, y = _data(1)
    rows = NamedSharding(mesh, P("data"))
    lowered = run.lower(p, state, jax.device_put(x[0], rows), jax.device_put(y[0], rows))
    for program in (hlo.program(lowered), hlo.program(lowered.compile())):  # before and after
        assert hlo.collectives(program, branches=False) == []
        # One conditional per fragment: collectives in its sync branch, none in the other;
        # one per leaf unfused (XLA may combine them when it compiles), else one.
        syncs = [
            c for c in _per_branch(program, functools.partial(_communicating, program)) if any(c)
        ]
        assert len(syncs) == fragments and all(c[0] == 0 for c in syncs), syncs
        if bucket_bytes is not None or backend == "ffi":
            assert syncs == [[0, 1]] * fragments


def _array_copies(instructions) -> list[hlo.Instruction]:
    """Copies of arrays of more than one element (scalar copies are free)."""
    return [i for i in instructions if i.opcode == "copy" and i.elements > 1]


@pytest.mark.parametrize(
    ("fragments", "delay", "mixing", "backend"),
    [(1, 0, 0.0, "xla"), (2, 0, 0.0, "xla"), (2, 2, 0.5, "xla"), (2, 2, 0.5, "auto")],
)
def test_a_step_that_does_not_sync_copies_nothing(fragments, delay, mixing, backend):
    """With params and state donated, a step with nothing due copies no array:
    its update is no copy of zeros, and the outer state, the local params and
    the pending averages (or handles, and what was sent) go through their
    conds in place."""
    mesh = _mesh()
    params = {k: jnp.ones((16, 8)) for k in "abcd"}  # alike: XLA would merge their zeros
    tx = _diloco(
        optax.adam(INNER_LR),
        sync_every=6,
        fragments=fragments,
        backend=backend,
        delay=delay,
        mixing=mixing,
    )
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")

    def step(params, state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
        return optax.apply_updates(params, updates), state

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    state = _put(state, mesh, specs)
    grads = jax.device_put(
        jax.tree.map(lambda x: jnp.ones((N, *x.shape)), params), NamedSharding(mesh, P("data"))
    )
    program = hlo.compiled(run, params, state, grads)
    # lax.cond's branch 0 is its false branch: the one every step with nothing due takes.
    not_due = [c.branches[0] for c in hlo.conditionals(program)]
    assert not_due
    for name in [program.entry, *not_due]:
        assert _array_copies(program.computations[name]) == [], name


# -- the surroundings --------------------------------------------------------


def test_get_stats_and_local_params_find_it_in_a_chain():
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(4)
    tx = optax.chain(optax.identity(), _diloco(optax.sgd(INNER_LR), sync_every=2, fragments=2))
    run, p, state = _start(tx, mesh, params)
    got, _, _ = _steps(run, p, state, x, y, mesh)
    densities = [float(jaxcomm.get_stats(st).density) for _, st in got]
    # Fragments of 14 and 7 elements: the first at odd steps + 1, the second at even.
    np.testing.assert_allclose(densities, [14 / 21, 7 / 21] * 2, rtol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"backend": "xla"},
        {"delay": 2, "mixing": 0.5, "backend": "xla"},
        {"delay": 2, "mixing": 0.5, "backend": "auto"},
    ],
    ids=["no_delay", "between_sync_and_landing", "between_start_and_finish"],
)
def test_checkpoint_resumes_bitwise_mid_cycle(tmp_path, options, monkeypatch):
    """Saved after 10 steps; with a delay of 2 fragment 0 synced after step 9
    and lands after step 11, so the checkpoint holds its pending average
    (xla) or the handle of its started exchange and what this device sent
    (auto: resumed as a new job would, which has no such exchange, the
    landing reduces what was sent)."""
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(20)
    tx = _diloco(optax.adam(INNER_LR), sync_every=4, fragments=2, **options)
    run, p, state = _start(tx, mesh, params)
    _, p10, state10 = _steps(run, p, state, x[:10], y[:10], mesh)  # mid-cycle: 10 % 4 == 2
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step10", (p10, state10))
    # Straight on from there, in this job: the run the resumed one must equal.
    _, p_straight, state_straight = _steps(run, p10, state10, x[10:], y[10:], mesh)
    # A fresh start as the template, as a new process would build it; a new
    # job draws its own nonce, so the started exchange is not its own.
    monkeypatch.setattr(_peers, "_nonce", [np.int32(_peers.job_nonce() ^ 1)])
    run, p, state = _start(tx, mesh, params)
    with ocp.StandardCheckpointer() as ckpt:
        p, state = ckpt.restore(tmp_path / "step10", (p, state))
    assert int(state.count) == 10
    if "delay" in options:  # fragment 0's pending average (or handle) is restored
        assert any(np.asarray(v).any() for v in state.pending[0])
    if options["backend"] == "auto":
        assert any(np.asarray(v).any() for v in jax.tree.leaves(state.kept.value[0]))
    _, p_resumed, state_resumed = _steps(run, p, state, x[10:], y[10:], mesh)

    want = jax.tree_util.tree_leaves_with_path((p_straight, state_straight))
    got = jax.tree.leaves((p_resumed, state_resumed))
    assert len(got) == len(want)
    for (path, w), g in zip(want, got, strict=True):
        w, g = np.asarray(w), np.asarray(g)
        assert w.dtype == g.dtype and w.shape == g.shape, jax.tree_util.keystr(path)
        if options["backend"] == "auto" and ".pending" in jax.tree_util.keystr(path):
            continue  # handles: which job started which exchange, not values
        assert w.tobytes() == g.tobytes(), f"{jax.tree_util.keystr(path)} differs after resuming"


def test_a_started_sync_is_finished_in_its_landing_step_only():
    """Overlapped: the sync's branch starts the exchange and finishes none, the
    landing's finishes it; nothing travels outside the conds."""
    mesh = _mesh()
    tx = _diloco(optax.adam(INNER_LR), sync_every=6, fragments=3, delay=2, backend="auto")
    run, p, state = _start(tx, mesh, _initial_params())
    x, y = _data(1)
    rows = NamedSharding(mesh, P("data"))
    program = hlo.compiled(run, p, state, jax.device_put(x[0], rows), jax.device_put(y[0], rows))
    assert hlo.collectives(program, branches=False) == []

    def calls(target):
        return _per_branch(program, lambda b: sum(i.target == target for i in program.walk(b)))

    starts, dones = calls("jaxcomm_allreduce_start"), calls("jaxcomm_allreduce_done")
    # Per fragment one cond starts (one group: float32) and one finishes.
    assert sorted(starts, reverse=True)[:3] == [[0, 1]] * 3 and sum(map(sum, starts)) == 3
    assert sorted(dones, reverse=True)[:3] == [[0, 1]] * 3 and sum(map(sum, dones)) == 3
    for instructions in program.computations.values():  # never both in one branch
        targets = {i.target for i in instructions}
        assert not {"jaxcomm_allreduce_start", "jaxcomm_allreduce_done"} <= targets


def test_a_landing_without_its_started_exchange_reduces_what_was_sent():
    """A handle this job never started (here forged: another job's nonce, a
    call site that does not exist) lands what the started exchange would
    have: the landing reduces what each device sent, kept in the state."""
    mesh = _mesh()
    x, y = _data(6)
    tx = _diloco(optax.sgd(INNER_LR), sync_every=4, delay=2, backend="auto")
    run, p, state = _start(tx, mesh, _initial_params())
    _, p4, state4 = _steps(run, p, state, x[:4], y[:4], mesh)  # synced after step 3
    forged = jnp.asarray([12345, 1 << 30, 7], jnp.int32)
    forged = jax.device_put(forged, NamedSharding(mesh, P()))
    in_flight = _ffi_module().in_flight()
    landed = []
    for pending in (state4.pending, ([forged] * len(state4.pending[0]),)):
        got, _, _ = _steps(run, p4, state4._replace(pending=pending), x[4:], y[4:], mesh)
        landed.append(got[-1][0])  # after step 5: landed
    for k in NAMES:
        assert landed[0][k].tobytes() == landed[1][k].tobytes(), k
    assert _ffi_module().in_flight() == in_flight - N  # the real one was taken once


# -- bad input ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"inner": None}, TypeError, "inner="),
        ({"outer": "sgd"}, TypeError, "outer="),
        ({"sync_every": 0}, ValueError, "sync_every=0"),
        ({"sync_every": 2.0}, ValueError, "sync_every=2.0"),
        ({"sync_every": True}, ValueError, "sync_every=True"),
        ({"fragments": 0}, ValueError, "fragments=0"),
        ({"fragments": 5}, ValueError, "fragments=5"),
        ({"wire_dtype": jnp.int16}, TypeError, "wire_dtype="),
        ({"algorithm": "tree"}, ValueError, "algorithm="),
        ({"backend": "nccl"}, ValueError, "backend="),
        ({"bucket_bytes": -1}, ValueError, "bucket_bytes=-1"),
        ({"delay": -1}, ValueError, "delay=-1"),
        ({"delay": 4}, ValueError, "delay=4 must be < sync_every=4"),
        ({"delay": 1.0}, TypeError, "delay=1.0"),
        ({"mixing": 1.0}, ValueError, "mixing=1.0"),
        ({"error_feedback": True}, ValueError, "wire_dtype=None nothing is dropped"),
        ({"mixing": -0.5}, ValueError, "mixing=-0.5"),
        ({"mixing": "half"}, ValueError, "mixing='half'"),
    ],
)
def test_bad_options_are_named_at_construction(options, error, named):
    kwargs = {
        "inner": optax.sgd(0.1),
        "outer": optax.sgd(0.7),
        "axis_name": "data",
        "sync_every": 4,
        **options,
    }
    with pytest.raises(error, match=re.escape(named)):
        jaxcomm.diloco(**kwargs)


def test_too_many_fragments_for_the_leaves_is_named_at_init():
    tx = _diloco(optax.sgd(0.1), sync_every=4, fragments=3)
    with jax.set_mesh(_mesh()), pytest.raises(ValueError, match="fragments=3"):
        tx.init({"a": jnp.zeros(3), "b": jnp.zeros(2)})


def test_update_without_params_or_with_reduced_gradients_is_refused():
    mesh = _mesh()
    tx = _diloco(optax.sgd(0.1), sync_every=4)
    _, params, state = _start(tx, mesh, _initial_params())
    specs = jaxcomm.state_specs(state, "data")

    def without_params(params, state):
        return tx.update(jaxcomm.local_params(state), state)[1]

    def at_global_params(params, state):  # grads of replicated params: already summed
        grads = jax.grad(_loss)(params, jnp.ones((1, FEATURES)), jnp.zeros(1))
        return tx.update(grads, state, params)[1]

    for fn, message in ((without_params, "needs params"), (at_global_params, "local_params")):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), specs), out_specs=specs))
        with pytest.raises(ValueError, match=message):
            f.trace(params, state)


def test_local_params_outside_shard_map_is_refused():
    tx = _diloco(optax.sgd(0.1), sync_every=4)
    with jax.set_mesh(_mesh()):
        state = tx.init(_initial_params())
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jaxcomm.local_params(state)
    with pytest.raises(ValueError, match="found 0"):
        jaxcomm.local_params(optax.sgd(0.1).init(_initial_params()))


@pytest.mark.slow  # starts a Python process
def test_building_starts_no_backend():
    """It may be built before jax.distributed.initialize, like the other transforms."""
    code = (
        "import jax, jax.numpy as jnp, optax, jaxcomm\n"
        "from jax._src import xla_bridge\n"
        "jaxcomm.diloco(optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True),\n"
        "               ('node', 'data'), sync_every=8, fragments=4, wire_dtype=jnp.bfloat16,\n"
        "               algorithm='hierarchical', backend='ffi')\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "print('not started')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not started" in proc.stdout
