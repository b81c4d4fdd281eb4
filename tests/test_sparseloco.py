"""sparseloco against a NumPy float64 SparseLoCo written here from the paper.

The problem is test_diloco's: 8 devices, each fitting its own linear
regression with plain SGD. Every step is replayed in float64 from the
state the device held before it (global params, every device's local
params and error buffers, the pending averages), so a top-k or rounding
choice that float32 and float64 could make differently never compounds;
the step's result is compared with the device's: the global params, the
local params, the error buffers, the pending averages and the stats. Also:
replicas bitwise equal after every step, the 2-bit quantiser within its
bound, the byte format round trip, both exchanges alike, an Orbax
checkpoint taken between a sync and its landing, and bad options named.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.transforms.sparseloco import (
    VALUE_BITS,
    _encode,
    _split,
    choose_exchange,
    leaf_plan,
    payload_bytes,
    sparse_outer,
)
from tests.test_diloco import (
    FRAGMENTS,
    INNER_LR,
    NAMES,
    OFFSETS,
    SHAPES,
    N,
    _data,
    _initial_params,
    _loss,
    _mesh,
    _np_grad,
    _put,
)

STEPS = 16
# Chunks of 4 with 2 sent each: the 5- and 7-element leaves end in a padded
# chunk, the scalar is one chunk of 1 with its one entry sent.
CHUNK, DENSITY, OUTER_LR, DECAY = 4, 0.5, 0.8, 0.9


# -- the reference ----------------------------------------------------------


def np_compress(acc, bits):
    """What a device sends of float64 ``acc``: the top 2 of each chunk of 4,
    each value rounded to the nearest of 2**bits levels spread evenly over
    [-s, s], s the largest magnitude sent in its chunk."""
    flat = acc.ravel()
    n = flat.size
    length = min(CHUNK, n)
    chunks, k = -(-n // length), max(1, int(DENSITY * length))
    rows = np.zeros(chunks * length)
    rows[:n] = flat
    rows = rows.reshape(chunks, length)
    where = np.argsort(-np.abs(rows), axis=1, kind="stable")[:, :k]
    picked = np.take_along_axis(rows, where, axis=1)
    scale = np.abs(picked).max(axis=1, keepdims=True)
    levels = np.linspace(-1, 1, 2**bits) * scale  # (chunks, 2**bits)
    nearest = np.argmin(np.abs(picked[:, :, None] - levels[:, None, :]), axis=2)
    values = np.take_along_axis(levels, nearest, axis=1)
    sent = np.zeros_like(rows)
    np.put_along_axis(sent, where, values, axis=1)
    return sent.reshape(-1)[:n].reshape(acc.shape)


def np_step(prev, x, y, s, *, sync_every, fragments, delay, mixing, bits):
    """One SparseLoCo step in float64 from ``prev`` = (global, local rows,
    error rows per name, pending per fragment); returns the same and the
    names sent and landed."""
    glob, local, error, pending = prev
    grads = [_np_grad(p, x[d], y[d]) for d, p in enumerate(local)]
    local = [
        {k: v - INNER_LR * g[k] for k, v in p.items()} for p, g in zip(local, grads, strict=True)
    ]
    error = [dict(e) for e in error]
    pending = list(pending)
    groups, offsets = FRAGMENTS[fragments], OFFSETS[sync_every, fragments]
    sent, landed = [], []
    for f, names in enumerate(groups):
        if (s + 1) % sync_every != offsets[f]:
            continue
        total = {k: 0.0 for k in names}
        for d in range(N):
            for k in names:
                acc = DECAY * error[d][k] + (glob[k] - local[d][k])
                out = np_compress(acc, bits)
                error[d][k] = acc - out
                total[k] = total[k] + out
        pending[f] = {k: total[k] / N for k in names}
        sent += names
    for f, names in enumerate(groups):
        synced = s - delay
        if synced < 0 or (synced + 1) % sync_every != offsets[f]:
            continue
        glob = {**glob, **{k: glob[k] - OUTER_LR * pending[f][k] for k in names}}
        local = [{**p, **{k: mixing * p[k] + (1 - mixing) * glob[k] for k in names}} for p in local]
        landed += names
    return (glob, local, error, pending), sent, landed


def _as_reference(params, state, fragments):
    """The device's (params, state) as np_step's float64 state."""
    f64 = lambda v: np.asarray(v, np.float64)  # noqa: E731
    glob = {k: f64(params[k]) for k in NAMES}
    local = [{k: f64(state.local.value[k][d]) for k in NAMES} for d in range(N)]
    groups = FRAGMENTS[fragments]
    error = [
        {
            k: f64(leaves[i][d])
            for names, leaves in zip(groups, state.error.value, strict=True)
            for i, k in enumerate(names)
        }
        for d in range(N)
    ]
    pending = [
        {k: f64(leaves[i]) for i, k in enumerate(names)}
        for names, leaves in zip(groups, state.pending or [None] * len(groups), strict=True)
        if leaves is not None
    ] or [None] * len(groups)
    return glob, local, error, pending


# -- running it -------------------------------------------------------------


def _sparseloco(**options):
    options = {
        "sync_every": 4,
        "learning_rate": OUTER_LR,
        "density": DENSITY,
        "chunk_size": CHUNK,
        "error_decay": DECAY,
        **options,
    }
    return jaxcomm.sparseloco(optax.sgd(INNER_LR), "data", **options)


def _start(tx, mesh, params):
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
    params = jax.device_put(params, NamedSharding(mesh, P()))
    return run, params, _put(state, mesh, specs), specs


def _run(run, params, state, x, y, mesh):
    """Per step the NumPy (params, state) and the replica check; one step in flight."""
    rows = NamedSharding(mesh, P("data"))
    out = []
    for s in range(len(x)):
        xs, ys = jax.device_put(x[s], rows), jax.device_put(y[s], rows)
        params, state, diff = jax.block_until_ready(run(params, state, xs, ys))
        out.append(jax.tree.map(np.asarray, (params, state, diff)))
    return out, params, state


def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)


# (sync_every, fragments, delay, mixing, value_bits, exchange)
CASES = [
    (4, 1, 0, 0.0, 2, "all_gather"),
    (4, 1, 2, 0.25, 2, "all_gather"),
    (4, 1, 1, 0.0, 4, "dense"),
    (6, 3, 0, 0.0, 2, "dense"),
    (6, 3, 1, 0.5, 2, "all_gather"),
    (6, 3, 3, 0.0, 8, "all_gather"),
]


@pytest.mark.parametrize(("sync_every", "fragments", "delay", "mixing", "bits", "exchange"), CASES)
def test_matches_the_float64_reference_step_by_step(
    sync_every, fragments, delay, mixing, bits, exchange
):
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(STEPS)
    tx = _sparseloco(
        sync_every=sync_every,
        fragments=fragments,
        delay=delay,
        mixing=mixing,
        value_bits=bits,
        exchange=exchange,
    )
    run, p, state, specs = _start(tx, mesh, params)
    assert all(s == P("data") for s in jax.tree.leaves(specs.error))
    got, _, _ = _run(run, p, state, x, y, mesh)
    prev = (p, state)
    groups = FRAGMENTS[fragments]
    syncs = 0
    for s, (gp, gs, diff) in enumerate(got):
        assert int(diff.worst()[1]) == 0, s  # global params, pending: bitwise replicas
        ref = _as_reference(*jax.tree.map(np.asarray, prev), fragments)
        (glob, local, error, pending), sent, landed = np_step(
            ref,
            x[s].astype(np.float64),
            y[s].astype(np.float64),
            s,
            sync_every=sync_every,
            fragments=fragments,
            delay=delay,
            mixing=mixing,
            bits=bits,
        )
        mine = _as_reference(gp, gs, fragments)
        for k in NAMES:
            _close(mine[0][k], glob[k], f"params {k} {s}")
            for d in range(N):
                _close(mine[1][d][k], local[d][k], f"local {k} {s} {d}")
                _close(mine[2][d][k], error[d][k], f"error {k} {s} {d}")
            if k in landed and not mixing:  # every device adopted the global params
                assert all(gs.local.value[k][d].tobytes() == gp[k].tobytes() for d in range(N))
            if k not in landed:
                assert gp[k].tobytes() == np.asarray(prev[0][k]).tobytes(), (k, s)
        if delay:
            for f, names in enumerate(groups):
                for k in names:
                    _close(mine[3][f][k], pending[f][k], f"pending {k} {s}")
        stats = jaxcomm.get_stats(gs)
        sizes = [int(np.prod(SHAPES[k])) for k in sent]
        if exchange == "all_gather":
            payload = payload_bytes(sizes, chunk_size=CHUNK, density=DENSITY, value_bits=bits)
            assert float(stats.payload_bytes) == payload, s
            assert float(stats.bytes_sent) == (N - 1) * payload, s
            assert int(stats.collectives) == bool(sent), s
        else:  # float32 values scattered into the leaves, one psum per leaf
            assert float(stats.payload_bytes) == 4 * sum(sizes), s
            assert int(stats.collectives) == len(sent), s
        chosen = sum(
            leaf_plan(n, CHUNK, DENSITY)[0] * leaf_plan(n, CHUNK, DENSITY)[2] for n in sizes
        )
        np.testing.assert_allclose(float(stats.density), chosen / 21, rtol=1e-6)
        syncs += bool(sent)
        prev = (gp, gs)
    assert syncs == STEPS * fragments // sync_every


def test_the_two_exchanges_agree():
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(8)
    finals = {}
    for exchange in ("all_gather", "dense"):
        run, p, state, _ = _start(_sparseloco(exchange=exchange), mesh, params)
        got, _, _ = _run(run, p, state, x, y, mesh)
        finals[exchange] = got[-1]
    for k in NAMES:  # the same sums, added in another order
        np.testing.assert_allclose(
            finals["all_gather"][0][k], finals["dense"][0][k], rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize("bits", VALUE_BITS)
def test_the_quantiser_stays_within_its_bound(bits):
    rng = np.random.default_rng(bits)
    outer = sparse_outer(density=0.05, chunk_size=256, value_bits=bits)
    x = jnp.asarray(rng.standard_normal(1000) * np.exp(rng.standard_normal(1000)), jnp.float32)
    where, codes, scale, values = jax.tree.map(np.asarray, outer._compress(x))
    rows = np.zeros(4 * 256, np.float32)
    rows[:1000] = np.asarray(x)
    rows = rows.reshape(4, 256)
    picked = np.take_along_axis(rows, where, axis=1)
    # The k = 12 largest magnitudes of each chunk, and nothing else.
    for c in range(4):
        top = np.sort(np.abs(rows[c]))[::-1][:12]
        np.testing.assert_array_equal(np.sort(np.abs(picked[c]))[::-1], top)
    np.testing.assert_array_equal(scale, np.abs(picked).max(axis=1))
    levels = 2**bits - 1
    error = np.abs(values - picked)
    assert (error <= scale[:, None] / levels * (1 + 1e-6)).all()
    assert codes.max() <= levels
    assert error.max() > 0.2 * scale.min() / levels  # the bound is met, not vacuous
    # The bytes round trip exactly.
    blob = _encode((jnp.asarray(where), jnp.asarray(codes), jnp.asarray(scale), None), bits)
    assert blob.size == payload_bytes([1000], chunk_size=256, density=0.05, value_bits=bits)
    where2, codes2, scale2, end = _split(blob, 0, where.shape, bits)
    assert end == blob.size
    np.testing.assert_array_equal(np.asarray(where2), where)
    np.testing.assert_array_equal(np.asarray(codes2), codes)
    np.testing.assert_array_equal(np.asarray(scale2), scale)


def test_choose_exchange_compares_bytes_per_device():
    payload = payload_bytes([1_000_000], chunk_size=4096, density=0.02, value_bits=2)
    dense = 4 * 1_000_000
    crossover = max(
        n for n in range(2, 10_000) if choose_exchange(payload, dense, n) == "all_gather"
    )
    assert crossover * payload <= 2 * dense < (crossover + 1) * payload
    assert choose_exchange(payload, dense, crossover + 1) == "dense"


def test_checkpoint_between_sync_and_landing_resumes_bitwise(tmp_path):
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(12)
    tx = _sparseloco(sync_every=4, fragments=1, delay=2, mixing=0.5)
    run, p, state, _ = _start(tx, mesh, params)
    _, p_straight, state_straight = _run(run, p, state, x, y, mesh)

    run, p, state, _ = _start(tx, mesh, params)
    _, p9, state9 = _run(run, p, state, x[:9], y[:9], mesh)  # synced after step 7, lands after 9
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step9", (p9, state9))
    run, p, state, _ = _start(tx, mesh, params)
    with ocp.StandardCheckpointer() as ckpt:
        p, state = ckpt.restore(tmp_path / "step9", (p, state))
    assert any(np.asarray(v).any() for v in state.pending[0])
    _, p_resumed, state_resumed = _run(run, p, state, x[9:], y[9:], mesh)
    want = jax.tree_util.tree_leaves_with_path((p_straight, state_straight))
    got = jax.tree.leaves((p_resumed, state_resumed))
    assert len(got) == len(want)
    for (path, w), g in zip(want, got, strict=True):
        assert np.asarray(w).tobytes() == np.asarray(g).tobytes(), jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"density": 0}, ValueError, "density=0"),
        ({"density": 1.5}, ValueError, "density=1.5"),
        ({"chunk_size": 0}, ValueError, "chunk_size=0"),
        ({"chunk_size": 70_000}, ValueError, "chunk_size=70000"),
        ({"value_bits": 3}, ValueError, "value_bits=3"),
        ({"value_bits": True}, ValueError, "value_bits=True"),
        ({"error_decay": 1.5}, ValueError, "error_decay=1.5"),
        ({"exchange": "ring"}, ValueError, "exchange='ring'"),
        ({"learning_rate": 0}, ValueError, "learning_rate=0"),
        ({"delay": 4}, ValueError, "delay=4"),
        ({"mixing": 1}, ValueError, "mixing=1"),
        ({"sync_every": 0}, ValueError, "sync_every=0"),
    ],
)
def test_bad_options_are_named_at_construction(options, error, named):
    with pytest.raises(error, match=re.escape(named)):
        _sparseloco(**options)


@pytest.mark.parametrize("delay", [0, 1])
def test_on_a_sharded_model_both_styles_agree(delay):
    """HSDP: shard_map over ("data", "fsdp") and jit over an Explicit "fsdp"
    axis run the same steps (each shard is chunked on its own); every copy of
    a shard is bitwise equal and keeps its sharding."""
    from tests import sharded_model as sm

    def make():
        return jaxcomm.sparseloco(
            optax.adam(1e-2), "data", sync_every=2, density=0.25, chunk_size=4, delay=delay
        )

    a, state, _ = sm.run(make(), sm.mesh(2, 4), 4)
    b, _, _ = sm.run_explicit(make(), sm.explicit_mesh(2, 4), 4)
    assert float(jaxcomm.get_stats(state).payload_bytes) > 0  # the 4th step synced
    for k, x in a.items():
        np.testing.assert_allclose(np.asarray(b[k]), np.asarray(x), rtol=1e-5, atol=1e-7)
        assert x.sharding.spec == sm.SPECS[k] or (k == "b" and not any(x.sharding.spec)), k
        for shard in x.addressable_shards:
            same = [s for s in x.addressable_shards if s.index == shard.index]
            assert all(
                np.asarray(s.data).tobytes() == np.asarray(shard.data).tobytes() for s in same
            )


def test_under_pmap_as_under_shard_map():
    """pmap has no replication types: the all-gather's result is plain, and
    the steps are those of shard_map."""
    mesh = _mesh()
    params = _initial_params()
    x, y = _data(4)
    tx = _sparseloco(sync_every=2, fragments=1, delay=1)
    run, p, state, _ = _start(tx, mesh, params)
    got, _, _ = _run(run, p, state, x, y, mesh)

    def step(params, state, x, y):
        grads = jax.grad(_loss)(jaxcomm.local_params(state), x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    p = jax.tree.map(lambda v: np.broadcast_to(v, (N, *np.shape(v))), params)
    state = jax.pmap(tx.init, axis_name="data")(p)
    run = jax.pmap(step, axis_name="data")
    for s in range(len(x)):
        p, state = jax.block_until_ready(run(p, state, x[s], y[s]))
    for k in NAMES:
        rows = np.asarray(p[k])
        assert all(rows[d].tobytes() == rows[0].tobytes() for d in range(N)), k
        np.testing.assert_allclose(rows[0], got[-1][0][k], rtol=1e-6, atol=1e-7)
