"""FP8 wires (float8_e4m3fn, float8_e5m2) against float64 NumPy, on 8 CPU devices.

The schedule (jaxcomm/collectives/_fp8.py): each device scales each part by
its own power of two 2^e, the largest with max|x| * 2^e <= M (448 or 57344),
rounds to 8 bits, and a reduce-scatter by all-to-all, float32 adds and an
all-gather of the reduced rows (rescaled the same way) follow. The stated
bound, per element of a mean, is |y - mean| <= (2u + u^2) * A, u = 2^-4
(e4m3) or 2^-3 (e5m2), A the part's largest |x| over all devices; N times
that for a sum. Checked here on random data, data spanning 12 decades,
zeros, tiny and huge values; and that nothing is added in 8 bits and the
payload travels as bytes, in the compiled HLO.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import hlo
from tests.harness import (
    assert_same_on_all_devices,
    mesh_of,
    run_sharded,
    run_steps,
    sharded_runner,
)

N = 8
WIRES = ["float8_e4m3fn", "float8_e5m2"]
U = {"float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}
F32_SLACK = 1e-5  # float32's own rounding (relative 2^-24 per add), well below the bound


@pytest.fixture
def mesh():
    return mesh_of((N,), ("data",))


def bound(wire) -> float:
    u = U[wire]
    return 2 * u + u * u


def _data(kind: str, rng, shape=(N, 1000)) -> np.ndarray:
    sign = rng.choice([-1.0, 1.0], shape)
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "wide":  # magnitudes spread over 12 decades
        x = sign * 10.0 ** rng.uniform(-6, 6, shape)
    elif kind == "huge":  # near float32's largest value: the scale is 2^-120 or so
        x = sign * rng.uniform(0.5, 1.0, shape) * float(np.finfo(np.float32).max)
    elif kind == "tiny":
        x = sign * rng.uniform(0.5, 1.0, shape) * 1e-25
    elif kind == "zeros":
        x = np.zeros(shape)
    elif kind == "one_device":  # one device holds the large values, the others small ones
        x = rng.standard_normal(shape) * np.where(np.arange(N)[:, None] == 3, 1e4, 1e-2)
    return x.astype(np.float32)


@functools.cache
def _allreduce_runner(op, wire):
    """One program per op and wire, compiled once per input shape and dtype."""
    return sharded_runner(
        lambda v: jaxcomm.allreduce(v, "data", op=op, wire_dtype=wire), mesh_of((N,), ("data",))
    )


def _allreduce(x, *, op="mean", wire="float8_e4m3fn"):
    return _allreduce_runner(op, wire)(x)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("kind", ["normal", "wide", "huge", "tiny", "zeros", "one_device"])
def test_mean_within_the_bound_of_float64(wire, kind):
    x = _data(kind, np.random.default_rng(1))
    got = _allreduce(x, wire=wire)
    assert_same_on_all_devices(got)
    assert np.all(np.isfinite(got))
    want = x.astype(np.float64).mean(0)
    a = np.abs(x.astype(np.float64)).max()
    err = np.abs(got[0].astype(np.float64) - want)
    assert np.all(err <= bound(wire) * a * (1 + F32_SLACK)), (err.max() / a, bound(wire))
    if kind == "zeros":
        assert np.all(got == 0)
    else:  # 8 bits do round: a result without error was not sent in them
        assert err.max() > 0


@pytest.mark.parametrize("wire", WIRES)
def test_sum_within_n_times_the_bound(wire):
    x = _data("normal", np.random.default_rng(2))
    got = _allreduce(x, op="sum", wire=wire)[0].astype(np.float64)
    want = x.astype(np.float64).sum(0)
    a = np.abs(x).max()
    assert np.all(np.abs(got - want) <= N * bound(wire) * a * (1 + F32_SLACK))


@pytest.mark.parametrize("wire", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_largest_values_stay_finite_for_every_sign_pattern(wire):
    """Every device at +-M_f32 (the mean is as large as the input), half of
    them each way (it cancels), and random signs: never inf or NaN."""
    big = float(np.finfo(np.float32).max)
    rows = [
        np.full((N, 64), big),
        np.full((N, 64), -big),
        np.where(np.arange(N)[:, None] % 2 == 0, big, -big) * np.ones((N, 64)),
        np.random.default_rng(3).choice([-big, big], (N, 64)),
    ]
    x = np.concatenate(rows, axis=1).astype(np.float32)
    got = _allreduce(x, wire=wire)[0].astype(np.float64)
    assert np.all(np.isfinite(got))
    want = x.astype(np.float64).mean(0)
    assert np.all(np.abs(got - want) <= bound(np.dtype(wire).name) * big * (1 + F32_SLACK))


@pytest.mark.parametrize("wire", WIRES)
def test_inf_and_nan_are_not_hidden(wire):
    x = _data("normal", np.random.default_rng(4))  # the mean test's shape: its program
    x[2, 5], x[6, 9] = np.inf, np.nan
    got = _allreduce(x, wire=wire)[0]
    assert not np.isfinite(got[5]) and np.isnan(got[9])
    # The other elements keep their scale: the non-finite ones take no part in it.
    rest = np.delete(np.arange(x.shape[1]), [5, 9])
    a = np.abs(np.delete(x, [5, 9], axis=1)).max()
    err = np.abs(got[rest] - x[:, rest].astype(np.float64).mean(0))
    assert np.all(err <= bound(wire) * a * (1 + F32_SLACK))


@pytest.mark.parametrize("wire", WIRES)
def test_hlo_adds_nothing_in_8_bits_and_sends_bytes(mesh, wire):
    """No all-reduce at all (nothing adds on the wire, no collective for the
    scales), an all-to-all of each device's n/N bytes plus a 2-byte exponent
    per destination row, and an all-gather of n/N bytes plus an exponent per
    device: u8 everywhere, never f8 (XLA's CPU compiler may widen what it
    does not move as bits)."""
    n = 4096

    def f(x):
        return jaxcomm.allreduce(x * 1.0, "data", op="mean", wire_dtype=wire)

    x = jax.device_put(jnp.ones(N * n), NamedSharding(mesh, P("data")))
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))
    found = hlo.collectives(hlo.compiled(step, x))
    assert sorted(c.collective for c in found) == ["all-gather", "all-to-all"], found
    for c in found:
        assert c.dtypes == {"u8"}, c
        assert c.elements == N * (n // N + 2), c  # the rows and one exponent each


def test_auto_with_a_chunk_mask_runs_the_fp8_schedule_not_ffi(mesh):
    """backend='auto' prefers ffi for a mask on CPU; ffi has no FP8 wire, so
    the mask goes through the xla schedule: no custom call, bytes only."""
    n, chunk = 256, 16
    mask = jnp.arange(n // chunk) % 3 == 0

    def f(x):
        return jaxcomm.allreduce(
            x, "data", op="mean", wire_dtype="float8_e5m2", chunk_mask=mask, chunk_size=chunk
        )

    x = jax.device_put(jnp.ones(N * n), NamedSharding(mesh, P("data")))
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    compiled = hlo.compiled(step, x)
    assert hlo.custom_calls(compiled) == []
    found = hlo.collectives(compiled)
    assert found and set().union(*(c.dtypes for c in found)) == {"u8"}, found


@pytest.mark.parametrize("wire", [jnp.float8_e4m3fn, "float8_e5m2"])
def test_options_without_an_fp8_schedule_are_refused_when_built(wire):
    with pytest.raises(ValueError, match="backend='xla' only"):
        jaxcomm.allreduce_gradients("data", wire_dtype=wire, backend="ffi")
    with pytest.raises(ValueError, match="backend='xla' only"):
        jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.5, wire_dtype=wire, backend="ffi")
    for algorithm in ("ring", "hierarchical"):
        axes = ("node", "local") if algorithm == "hierarchical" else "data"
        with pytest.raises(ValueError, match=f"algorithm='{algorithm}'"):
            jaxcomm.allreduce_gradients(axes, wire_dtype=wire, algorithm=algorithm)


def test_reduce_scatter_and_all_gather_refuse_an_fp8_wire(mesh):
    for collective in (jaxcomm.reduce_scatter, jaxcomm.all_gather):
        with pytest.raises(TypeError, match="FP8 wires are for allreduce"):
            run_sharded(
                lambda v, c=collective: c(v, "data", wire_dtype="float8_e4m3fn"),
                mesh,
                np.ones((N, 8), np.float32),
            )


# Error feedback: NumPy replay of one device's cast of one leaf, written from
# the docstring: 2^e the largest power of two with max|v| * 2^e <= M.
def _cast_np(v: np.ndarray, wire: str) -> np.ndarray:
    top = float(ml_dtypes.finfo(wire).max)
    a = float(np.abs(v).max())
    if a == 0:
        return v
    e = int(np.floor(np.log2(top / a)))
    e += 1 if a * 2.0 ** (e + 1) <= top else 0  # log2 may land one below
    e -= 1 if a * 2.0**e > top else 0
    sent = np.clip(v.astype(np.float64) * 2.0**e, -top, top).astype(np.float32)
    return (sent.astype(wire).astype(np.float64) * 2.0**-e).astype(np.float32)


STEPS = 20
SIZES = {"w": 512, "b": 32}


def _ef_grads(rng):
    """Large values that cancel across devices (so a device's own cast error
    is far above the error of the small mean) plus noise; b 1000x smaller."""
    big = 1000.0 * rng.standard_normal((N, SIZES["w"]))
    big -= big.mean(0)
    return [
        {
            "w": (big + rng.standard_normal((N, SIZES["w"]))).astype(np.float32),
            "b": (1e-3 * rng.standard_normal((N, SIZES["b"]))).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("bucket_bytes", [None, float("inf")])
def test_error_feedback_keeps_the_scaled_cast_and_the_sum_tracks_the_mean(mesh, wire, bucket_bytes):
    """The residual is exactly what each device's scaled cast dropped, leaf by
    leaf (each leaf has its own scale, also in a bucket of both); over 20
    steps the summed outputs stay within one residual plus the shared
    re-rounding of each step's reduced rows (|r_t| <= u/(1-u) max|out_t|) of
    the summed true means, and where the cast errors are large (w) drift
    several times less than without."""
    grads = _ef_grads(np.random.default_rng(5))
    params = {k: np.zeros(s, np.float32) for k, s in SIZES.items()}
    runs = {}
    for ef in (False, True):
        tx = jaxcomm.allreduce_gradients(
            "data", wire_dtype=wire, error_feedback=ef, bucket_bytes=bucket_bytes
        )
        runs[ef] = run_steps(tx, params, grads, mesh)

    e = {k: np.zeros((N, s), np.float32) for k, s in SIZES.items()}
    for g in grads:
        for k in SIZES:
            v = g[k] + e[k]
            e[k] = v - np.stack([_cast_np(row, wire) for row in v])
    for k in SIZES:
        np.testing.assert_array_equal(runs[True][2].residual.value[k][:, 0], e[k])

    u = U[wire]
    for k in SIZES:
        outs = [step[k][0].astype(np.float64) for step in runs[True][0]]
        true_total = sum(g[k].astype(np.float64).mean(0) for g in grads)
        drift = np.abs(sum(outs) - true_total)
        rerounding = sum(u / (1 - u) * np.abs(o).max() for o in outs)
        slack = F32_SLACK * sum(np.abs(g[k]).max() for g in grads)
        assert np.all(drift <= np.abs(e[k].astype(np.float64).mean(0)) + rerounding + slack)
        if k == "w":  # where the cast errors dwarf the re-rounding of the small mean
            no_ef = np.abs(sum(step[k][0] for step in runs[False][0]) - true_total)
            assert drift.mean() < no_ef.mean() / 3, (drift.mean(), no_ef.mean())


@pytest.mark.parametrize("bucket_bytes,buckets,parts", [(0, 2, 1), (math.inf, 1, 2)])
def test_stats_count_one_byte_an_element_and_the_exponents(mesh, bucket_bytes, buckets, parts):
    """payload_bytes: 1 byte per element plus N(parts + 1) bytes of exponents
    per bucket; bytes_sent = 2(N-1)/N of it is what the compiled all-to-all
    and all-gather move: (N-1) x (row + 2) bytes each."""
    tx = jaxcomm.allreduce_gradients("data", wire_dtype="float8_e4m3fn", bucket_bytes=bucket_bytes)
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    state = tx.init(params)

    def step(p, s, g):
        return tx.update(jax.tree.map(lambda a: a[0], g), s, p)

    grads = jax.tree.map(lambda a: jnp.ones((N, *a.shape)), params)
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )
    compiled = f.lower(params, state, grads).compile()
    sent = 0
    for c in hlo.collectives(compiled):
        assert c.dtypes == {"u8"}, c
        # Each collective's result holds N rows; a device sends N-1 of them.
        sent += c.bytes * (N - 1) // N
    _, state = jax.block_until_ready(compiled(params, state, grads))  # the program read
    stats = jaxcomm.get_stats(state)
    elements = sum(a.size for a in jax.tree.leaves(params))
    assert float(stats.payload_bytes) == elements + buckets * N * (parts + 1)
    assert float(stats.bytes_sent) == pytest.approx(sent, rel=1e-6)


@pytest.mark.parametrize("wire", WIRES)
def test_chunk_sparse_exchanges_chunks_within_the_bound(mesh, wire):
    """chunk_sparse(sgd(lr)) with residual_decay=0: a step's update is
    -lr * mean(g) on the exchanged chunks (all at step 0, then half, packed
    under the static bound) within the bound, and exactly 0 elsewhere."""
    lr, chunk = 0.5, 16
    tx = jaxcomm.chunk_sparse(
        optax.sgd(lr),
        "data",
        density=0.5,
        warmup_steps=0,
        residual_decay=0.0,
        chunk_size=chunk,
        wire_dtype=wire,
    )
    rng = np.random.default_rng(6)
    size = 13 * 16
    grads = [
        {
            "w": (rng.standard_normal((N, size)) * 10.0 ** rng.uniform(-2, 2, size)).astype(
                np.float32
            )
        }
        for _ in range(4)
    ]
    updates, _, _ = run_steps(tx, {"w": np.zeros(size, np.float32)}, grads, mesh)
    for t, (g, upd) in enumerate(zip(grads, updates, strict=True)):
        assert_same_on_all_devices(upd)
        want = (-lr * g["w"].astype(np.float64).mean(0)).reshape(13, chunk)
        got = upd["w"][0].astype(np.float64).reshape(13, chunk)
        tol = lr * bound(wire) * np.abs(g["w"]).max() * (1 + F32_SLACK)
        close = np.all(np.abs(got - want) <= tol, axis=1)
        zero = np.all(got == 0, axis=1)
        assert np.all(close | zero), t
        exchanged = close & ~zero
        assert exchanged.sum() == (13 if t == 0 else 7), (t, exchanged)


@pytest.mark.parametrize("axes", [("a", "b"), "b"])
def test_over_two_axes_or_one_of_them(axes):
    """The all-to-all and all-gather follow the ranks of a tuple of axes, and
    a reduction over one axis of two reduces each group on its own."""
    x = _data("wide", np.random.default_rng(7), (N, 96))
    groups = x.reshape(1, N, -1) if axes != "b" else x.reshape(2, 4, -1)
    out = run_sharded(
        lambda v: jaxcomm.allreduce(v, axes, op="mean", wire_dtype="float8_e4m3fn"),
        mesh_of((2, 4), ("a", "b")),
        x,
    ).reshape(groups.shape)
    for group, got in zip(groups, out, strict=True):
        assert_same_on_all_devices(got)
        err = np.abs(got[0] - group.astype(np.float64).mean(0))
        assert np.all(err <= bound("float8_e4m3fn") * np.abs(group).max() * (1 + F32_SLACK))


def test_under_pmap():
    x = _data("wide", np.random.default_rng(7), (N, 96))
    f = jax.pmap(lambda v: jaxcomm.allreduce(v, "i", wire_dtype="float8_e5m2"), axis_name="i")
    got = np.asarray(jax.block_until_ready(f(x)))
    assert_same_on_all_devices(got)
    err = np.abs(got[0] - x.astype(np.float64).sum(0))
    assert np.all(err <= N * bound("float8_e5m2") * np.abs(x).max() * (1 + F32_SLACK))


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16])
def test_16_bit_inputs_add_only_their_own_rounding(dtype):
    x = _data("normal", np.random.default_rng(8)).astype(dtype)
    got = _allreduce(x, wire="float8_e4m3fn")
    assert got.dtype == dtype
    want = x.astype(np.float64).mean(0)
    own = float(jnp.finfo(dtype).eps) / 2 * np.abs(want)  # rounding the result to dtype
    a = np.abs(x.astype(np.float64)).max()
    err = np.abs(got[0].astype(np.float64) - want)
    assert np.all(err <= bound("float8_e4m3fn") * a * (1 + F32_SLACK) * (1 + 2**-7) + own)
