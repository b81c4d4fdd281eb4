"""Integer wires (int8, int4) against NumPy, on 8 CPU devices.

The schedule (jaxcomm/collectives/_quantized.py): each device cuts each part
into chunks of 256 elements, scales each by max|x| / Q (Q = 127, 7) and sends
round(x / s); an all-to-all of the codes and scales, float32 decodes and
adds, the reduced row encoded again (chunks from the row's start) and an
all-gather. Stated bound, per element of a mean: |y - mean| <= A / Q, A the
largest |x| over all devices within 510 elements; N times that for a sum.
Checked against a float32 NumPy replay of the schedule (independent code,
the same arithmetic), against float64 within the bound, and in the compiled
HLO (bytes, int4 two to a byte, nothing added on the wire).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.collectives import Wire, _quantized
from tests import hlo
from tests.harness import (
    assert_same_on_all_devices,
    mesh_of,
    run_as_users_do,
    run_sharded,
    run_steps,
    sharded_runner,
)

N = 8
CHUNK = 256
WIRES = ["int8", "int4"]
Q = {"int8": 127, "int4": 7}
WINDOW = 2 * (CHUNK - 1)  # the elements whose magnitude an element's error depends on
# float32's own rounding: two decodes, N adds and the scalings, (N + 4) 2^-24 A
# at most, below 2^-20 A for N <= 12.
ROUNDING = 2.0**-20


def _local_max(x: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """A per element: the largest |x| over all devices within `window`."""
    a = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1).max(0)
    n = a.size
    return np.array([a[max(0, e - window) : e + window + 1].max() for e in range(n)])


@functools.cache
def _allreduce_runner(n_devices: int, op: str, wire):
    """One program per device count, op and wire, compiled once per input shape."""
    return sharded_runner(
        lambda v: jaxcomm.allreduce(v, "data", op=op, wire_dtype=wire),
        mesh_of((n_devices,), ("data",)),
    )


def _allreduce(x, n_devices: int, *, op="mean", wire="int8"):
    return _allreduce_runner(n_devices, op, wire)(x)


# -- a NumPy replay of the schedule, written from the module docstring --------


def _np_roundtrip(a: np.ndarray, wire: str) -> np.ndarray:
    """What one part's codes represent, in float32: chunks from its start."""
    a = np.asarray(a, np.float32).reshape(-1)
    n = a.size
    t = -(-n // CHUNK)
    p = np.zeros(t * CHUNK, np.float32)
    p[:n] = a
    p = p.reshape(t, CHUNK)
    top = np.abs(p).max(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = np.where(np.isfinite(top), top / np.float32(Q[wire]), np.nan).astype(np.float32)
        ok = s > 0
        c = np.round(p / np.where(ok, s, np.float32(1))[:, None])
        c = np.where(ok[:, None], np.clip(c, -Q[wire], Q[wire]), 0).astype(np.float32)
        big = np.finfo(np.float32).max
        return np.clip(c * s[:, None], -big, big).reshape(-1)[:n]


def _np_schedule(x: np.ndarray, wire: str, *, op="mean", parts=None) -> np.ndarray:
    """The allreduce of x (devices, n) float32 replayed in float32."""
    devices, n = x.shape
    sizes = parts or [n]
    per = 2 if wire == "int4" else 1
    row = -(-n // (devices * per)) * per
    offsets = np.cumsum([0, *sizes])
    decoded = np.zeros((devices, devices * row), np.float32)
    for d in range(devices):
        decoded[d, :n] = np.concatenate(
            [_np_roundtrip(x[d, offsets[k] : offsets[k + 1]], wire) for k in range(len(sizes))]
        )
    if op == "mean":
        power = float(1 << (devices - 1).bit_length())
        total = decoded[0] * np.float32(1 / power)
        for d in range(1, devices):
            total = total + decoded[d] * np.float32(1 / power)
        reduced = total * np.float32(power / devices)
    else:
        reduced = decoded[0]
        for d in range(1, devices):
            reduced = reduced + decoded[d]
    out = np.concatenate(
        [_np_roundtrip(reduced[j * row : (j + 1) * row], wire) for j in range(devices)]
    )
    return out[:n]


# -- the result ---------------------------------------------------------------

SIZES = [1, 3, 250, 257, 5 * 103, 1000, 2 * CHUNK * 8 + 5]  # not multiples of CHUNK or N
OPS = ["mean", "sum"]


def _replay_inputs(devices: int) -> list[np.ndarray]:
    """Per size, (devices, n) float32 whose magnitudes change along the input,
    so that a chunk's scale matters."""
    rng = np.random.default_rng(devices)
    xs = []
    for n in SIZES:
        x = rng.standard_normal((devices, n)) * 10.0 ** rng.uniform(-2, 2, n)
        xs.append(x.astype(np.float32))
    return xs


@functools.cache
def _replay_results(devices: int) -> dict:
    """{(wire, op): per size, the allreduce of _replay_inputs(devices)}: every
    size, op and wire a call of its own, all in one program per device count
    (one compile instead of 28)."""

    def calls(*xs):
        return {
            (wire, op): [jaxcomm.allreduce(x, "data", op=op, wire_dtype=wire) for x in xs]
            for wire in WIRES
            for op in OPS
        }

    mesh = mesh_of((devices,), ("data",))
    return run_sharded(calls, mesh, *_replay_inputs(devices))


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("devices", [2, 3, 8])
@pytest.mark.parametrize("op", OPS)
def test_matches_the_numpy_replay_and_the_bound(wire, devices, op):
    results = _replay_results(devices)[wire, op]
    for n, x, got in zip(SIZES, _replay_inputs(devices), results, strict=True):
        assert_same_on_all_devices(got)
        a = _local_max(x)
        replay = _np_schedule(x, wire, op=op)
        np.testing.assert_allclose(got[0], replay, rtol=0, atol=1e-6 * a.max(), err_msg=str(n))
        want = x.astype(np.float64).mean(0) if op == "mean" else x.astype(np.float64).sum(0)
        times = 1 if op == "mean" else devices
        err = np.abs(got[0].astype(np.float64) - want)
        assert np.all(err <= times * (1 / Q[wire] + ROUNDING) * a), (n, np.max(err / a))
        if n > 3:  # int codes do round: a result without error was not sent in them
            assert err.max() > 0


@pytest.mark.parametrize("wire", WIRES)
def test_shapes_and_bfloat16_input(wire):
    """Any leaf shape comes back in its shape; a bfloat16 input adds only
    the rounding of the result to bfloat16."""
    rng = np.random.default_rng(1)
    shapes = [(), (7, 5), (3, 300), (2, 2, 129)]
    xs = [rng.standard_normal((N, *shape)).astype(jnp.bfloat16) for shape in shapes]
    outs = run_sharded(  # a call per shape, in one program
        lambda *vs: [jaxcomm.allreduce(v, "data", op="mean", wire_dtype=wire) for v in vs],
        mesh_of((N,), ("data",)),
        *xs,
    )
    for shape, x, got in zip(shapes, xs, outs, strict=True):
        assert got.shape == x.shape and got.dtype == jnp.bfloat16
        want = x.astype(np.float64).reshape(N, -1).mean(0)
        own = 2.0**-8 * np.abs(want)  # the result rounded to bfloat16
        a = _local_max(x.reshape(N, -1))
        err = np.abs(got[0].astype(np.float64).reshape(-1) - want)
        assert np.all(err <= (1 / Q[wire] + ROUNDING) * a + own), shape


@pytest.mark.parametrize("wire", WIRES)
def test_zeros_stay_zeros_and_a_huge_value_costs_only_its_neighbours(wire):
    x = np.zeros((N, 3000), np.float32)
    assert np.all(_allreduce(x, N, wire=wire) == 0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((N, 3000)).astype(np.float32)
    x[5, 1200] = 1e6
    got = _allreduce(x, N, wire=wire)[0].astype(np.float64)
    err = np.abs(got - x.astype(np.float64).mean(0))
    far = np.abs(np.arange(3000) - 1200) > WINDOW
    small = np.abs(x[:, far]).max()
    # Far from it, the error is a step of the small values' scale, a million
    # times below a step of the huge value's, which the element near it take.
    assert np.all(err[far] <= (1 / Q[wire] + ROUNDING) * small)
    assert err[~far].max() <= (1 / Q[wire] + ROUNDING) * 1e6
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("wire", WIRES)
def test_inf_and_nan_make_their_chunks_nan_and_nothing_else(wire):
    # 3000 elements, as above: the same program.
    x = np.random.default_rng(3).standard_normal((N, 3000)).astype(np.float32)
    x[2, 300], x[6, 1500] = np.inf, np.nan
    got = _allreduce(x, N, wire=wire)[0]
    assert np.isnan(got[300]) and np.isnan(got[1500])
    far = (np.abs(np.arange(3000) - 300) > WINDOW) & (np.abs(np.arange(3000) - 1500) > WINDOW)
    assert np.all(np.isfinite(got[far]))
    err = np.abs(got[far] - x[:, far].astype(np.float64).mean(0))
    assert np.all(err <= (1 / Q[wire] + ROUNDING) * np.abs(x[:, far]).max())


@pytest.mark.parametrize("wire", [jnp.int8, jnp.int4])
def test_largest_values_stay_finite_in_a_mean(wire):
    big = float(np.finfo(np.float32).max)
    x = np.random.default_rng(4).choice([-big, big], (N, 600)).astype(np.float32)
    x[:, :300] = big
    got = _allreduce(x, N, wire=wire)[0].astype(np.float64)
    assert np.all(np.isfinite(got))
    want = x.astype(np.float64).mean(0)
    assert np.all(np.abs(got - want) <= (1 / Q[np.dtype(wire).name] + ROUNDING) * big)


def test_int4_codes_survive_the_packing():
    """Every code in [-7, 7], in both nibbles, unpacks to itself."""
    codes = jnp.asarray(
        np.stack(np.meshgrid(np.arange(-7, 8), np.arange(-7, 8))).T.reshape(-1), jnp.int8
    )
    b = _quantized._pack(codes, jnp.int4)
    assert b.dtype == jnp.uint8 and b.size == codes.size // 2
    np.testing.assert_array_equal(np.asarray(_quantized._unpack(b, jnp.int4)), np.asarray(codes))


def test_the_header_holds_every_chunk_a_row_touches():
    """header_chunks' bound for several parts, against every row's count."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        sizes = tuple(int(s) for s in rng.integers(1, 1200, rng.integers(1, 6)))
        devices = int(rng.integers(2, 9))
        n = sum(sizes)
        for wire in WIRES:
            row = -(-n // (devices * (2 if wire == "int4" else 1))) * (2 if wire == "int4" else 1)
            start = np.cumsum([0, *sizes])
            chunk_of = np.concatenate(
                [
                    np.arange(s) // CHUNK + sum(-(-t // CHUNK) for t in sizes[:k])
                    for k, s in enumerate(sizes)
                ]
            )
            chunk_of = np.concatenate([chunk_of, np.full(devices * row - n, chunk_of[-1])])
            touched = max(len(set(chunk_of[j * row : (j + 1) * row])) for j in range(devices))
            assert touched <= _quantized.header_chunks(n, len(sizes), devices, wire), (sizes, start)


# -- the wire in the compiled program ------------------------------------------


def _bytes_of(collective: hlo.Instruction) -> float:
    assert collective.dtypes == {"u8"}, collective
    return collective.bytes


@pytest.mark.parametrize("wire,code_bytes", [("int8", 512), ("int4", 256)])
def test_hlo_sends_bytes_and_int4_half_as_many(wire, code_bytes):
    """4096 elements a device: rows of 512 elements, two chunks each. The
    all-to-all and the all-gather each move N rows of 512 (int8) or 256
    (int4) bytes of codes plus 2 float32 scales, as u8; nothing adds on the wire."""
    n = 4096
    mesh = mesh_of((N,), ("data",))

    def f(x):
        return jaxcomm.allreduce(x * 1.0, "data", op="mean", wire_dtype=wire)

    x = jax.device_put(jnp.ones(N * n), NamedSharding(mesh, P("data")))
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))
    found = hlo.collectives(hlo.compiled(step, x))
    assert sorted(c.collective for c in found) == ["all-gather", "all-to-all"], found
    for c in found:
        assert _bytes_of(c) == N * (code_bytes + 2 * 4), c
    assert _quantized.exchange_bytes(n, 1, N, wire) == (N * (code_bytes + 8),) * 2


@pytest.mark.parametrize("wire", [*WIRES, "float8_e4m3fn"])
@pytest.mark.parametrize("bucket_bytes", [0, math.inf])
def test_stats_are_what_the_compiled_collectives_move(wire, bucket_bytes):
    """bytes_sent = 2(N-1)/N x payload_bytes is what a device sends to its
    peers: (N-1)/N of each compiled collective's result, padding included
    (b's 33 elements are not a multiple of N, for FP8 too)."""
    tx = jaxcomm.allreduce_gradients("data", wire_dtype=wire, bucket_bytes=bucket_bytes)
    params = {"w": jnp.ones((64, 33)), "b": jnp.zeros(33)}
    mesh = mesh_of((N,), ("data",))
    state = tx.init(params)

    def step(p, s, g):
        return tx.update(jax.tree.map(lambda a: a[0], g), s, p)

    grads = jax.tree.map(lambda a: jnp.ones((N, *a.shape)), params)
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )
    compiled = f.lower(params, state, grads).compile()
    found = hlo.collectives(compiled)
    assert len(found) == (4 if bucket_bytes == 0 else 2), found
    sent = sum(_bytes_of(c) * (N - 1) / N for c in found)
    _, state = jax.block_until_ready(compiled(params, state, grads))  # the program read
    stats = jaxcomm.get_stats(state)
    assert float(stats.bytes_sent) == pytest.approx(sent, rel=1e-6)
    # By hand for int8, one leaf: w's 2112 elements make rows of 264 (two
    # chunks, the second touched by rows 0..7 alike: K = 2), b's 33 rows of 5.
    if wire == "int8" and bucket_bytes == 0:
        assert float(stats.payload_bytes) == (8 * (2 * 264 + 4 * 4) + 8 * (2 * 5 + 2 * 4)) / 2


# -- error feedback -----------------------------------------------------------

LEAVES = {"w": 700, "b": 33}


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("bucket_bytes", [None, math.inf])
def test_error_feedback_residual_is_what_this_devices_encoding_dropped(wire, bucket_bytes):
    """Each leaf is cut into chunks from its own start, in a bucket too, so
    the residual is v - roundtrip(v) leaf by leaf (NumPy replay; to float32's
    rounding of the decoded product, which XLA may fuse into v - c * s)."""
    rng = np.random.default_rng(6)
    grads = [
        {
            k: (rng.standard_normal((N, s)) * 10.0 ** rng.uniform(-3, 3, s)).astype(np.float32)
            for k, s in LEAVES.items()
        }
        for _ in range(5)
    ]
    tx = jaxcomm.allreduce_gradients(
        "data", wire_dtype=wire, error_feedback=True, bucket_bytes=bucket_bytes
    )
    params = {k: np.zeros(s, np.float32) for k, s in LEAVES.items()}
    _, _, state = run_steps(tx, params, grads, mesh_of((N,), ("data",)))
    e = {k: np.zeros((N, s), np.float32) for k, s in LEAVES.items()}
    ulps = dict.fromkeys(LEAVES, 0.0)  # a rounding a step, carried into the next v
    for g in grads:
        for k in LEAVES:
            v = g[k] + e[k]
            e[k] = v - np.stack([_np_roundtrip(row, wire) for row in v])
            ulps[k] += 2.0**-23 * np.abs(v).max()
    for k in LEAVES:
        np.testing.assert_allclose(state.residual.value[k][:, 0], e[k], rtol=0, atol=ulps[k])
        assert np.abs(e[k]).max() > 0


@functools.cache
def _sgd_on_a_quadratic(wire, error_feedback: bool, seed: int = 7, steps: int = 120):
    """Device i's loss is |w - c_i|^2 / 2 (the c_i far apart, so each
    device's gradient stays large at the optimum, mean(c)); SGD with a
    decaying step; c is _quadratic_centres(seed). Returns the final w
    (cached: the float32 run serves both wires)."""
    c = _quadratic_centres(seed)
    mesh = mesh_of((N,), ("data",))
    lr = optax.exponential_decay(0.5, transition_steps=1, decay_rate=0.95)
    tx = optax.chain(
        jaxcomm.allreduce_gradients("data", wire_dtype=wire, error_feedback=error_feedback),
        optax.sgd(lr),
    )
    params = {"w": jnp.zeros(c.shape[1])}
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")

    def step(p, s, ci):
        u, s = tx.update({"w": p["w"] - ci[0]}, s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    )
    state = jax.device_put(state, jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs))
    cs = jax.device_put(c, NamedSharding(mesh, P("data")))
    for _ in range(steps):
        params, state = jax.block_until_ready(run(params, state, cs))
    return np.asarray(params["w"], np.float64)


def _quadratic_centres(seed: int) -> np.ndarray:
    return (10.0 * np.random.default_rng(seed).standard_normal((N, 300))).astype(np.float32)


@pytest.mark.parametrize("wire", WIRES)
def test_error_feedback_sgd_converges_where_float32_does(wire):
    """float32 ends at mean(c) to 1e-3. With error feedback each device's
    encoding error comes back; what stays is the re-encoding of the reduced
    row, which no residual holds: near the optimum that row is the mean of
    the residuals' change, at most A / Q (A = max|c_i - mean(c)|), so the
    point SGD settles at is off by at most A / (2 Q^2), plus the last
    step's residual, 0.5 * 0.95^119 * A / Q. Without it the codes round
    the large gradients to a bias many times that."""
    c = _quadratic_centres(7)
    exact = _sgd_on_a_quadratic(None, False, 7)
    assert np.abs(exact - c.astype(np.float64).mean(0)).max() < 1e-3
    with_ef = np.abs(_sgd_on_a_quadratic(wire, True, 7) - exact).max()
    without = np.abs(_sgd_on_a_quadratic(wire, False, 7) - exact).max()
    a = np.abs(c - c.astype(np.float64).mean(0)).max()
    q = Q[wire]
    assert with_ef <= a / (2 * q * q) + 0.5 * 0.95**119 * a / q + 1e-3, with_ef
    assert without > 10 * with_ef, (without, with_ef)


@pytest.mark.parametrize("wire", WIRES)
def test_chunk_sparse_exchanges_chunks_within_the_bound(wire):
    """chunk_sparse(sgd(lr)) with residual_decay=0 over an int wire: a step's
    update is -lr * mean(g) within lr * A / Q on the exchanged chunks (all
    at step 0, then 7 of 13, packed under the static bound), exactly 0 elsewhere."""
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
    rng = np.random.default_rng(9)
    size = 13 * chunk
    grads = [
        {
            "w": (rng.standard_normal((N, size)) * 10.0 ** rng.uniform(-2, 2, size)).astype(
                np.float32
            )
        }
        for _ in range(4)
    ]
    updates, _, _ = run_steps(
        tx, {"w": np.zeros(size, np.float32)}, grads, mesh_of((N,), ("data",))
    )
    for t, (g, upd) in enumerate(zip(grads, updates, strict=True)):
        assert_same_on_all_devices(upd)
        want = (-lr * g["w"].astype(np.float64).mean(0)).reshape(13, chunk)
        got = upd["w"][0].astype(np.float64).reshape(13, chunk)
        tol = lr * (1 / Q[wire] + ROUNDING) * np.abs(g["w"]).max()
        close = np.all(np.abs(got - want) <= tol, axis=1)
        zero = np.all(got == 0, axis=1)
        assert np.all(close | zero), t
        assert (close & ~zero).sum() == (13 if t == 0 else 7), t
        assert np.abs(got - want)[close & ~zero].max() > 0  # the codes round


# -- diloco -------------------------------------------------------------------


@pytest.mark.parametrize("wire", WIRES)
def test_diloco_outer_step_within_the_bound_of_float64(wire):
    """Inner sgd(lr), outer sgd(1.0), a sync every 2 steps: the new global
    params are params - mean(params - local_i), local_i = params - lr (g0 + g1),
    the mean sent over the int wire (per leaf: A / Q of the pseudo-gradients)."""
    lr = 0.1
    mesh = mesh_of((N,), ("data",))
    rng = np.random.default_rng(8)
    shapes = {"a": (300,), "b": (5, 7)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [
        {k: rng.standard_normal((N, *s)).astype(np.float32) for k, s in shapes.items()}
        for _ in range(2)
    ]
    tx = jaxcomm.diloco(optax.sgd(lr), optax.sgd(1.0), "data", sync_every=2, wire_dtype=wire)
    _, p, state = run_as_users_do(tx, params, grads, mesh)
    stats = jaxcomm.get_stats(state)
    payload = sum(_quantized.payload_bytes(int(np.prod(s)), 1, N, wire) for s in shapes.values())
    assert float(stats.payload_bytes) == payload
    for k in shapes:
        local = params[k][None].astype(np.float64) - lr * (
            grads[0][k].astype(np.float64) + grads[1][k]
        )
        delta = params[k][None] - local
        want = params[k] - delta.mean(0)
        a = np.abs(delta).max()
        err = np.abs(np.asarray(p[k], np.float64) - want)
        assert np.all(err <= (1 / Q[wire] + ROUNDING) * a + 1e-6 * np.abs(want)), k
        assert err.max() > 0
        assert all(
            np.asarray(state.local.value[k])[d].tobytes() == np.asarray(p[k]).tobytes()
            for d in range(N)
        )


# -- options ------------------------------------------------------------------


@pytest.mark.parametrize("wire", ["int8", "int4", jnp.int8, jnp.int4])
def test_names_and_refusals(wire):
    assert Wire.of(wire).quantized and Wire.of(wire).narrow and not Wire.of(wire).fp8
    with pytest.raises(ValueError, match=r"wire_dtype=int[48] runs on backend='xla' only"):
        jaxcomm.allreduce_gradients("data", wire_dtype=wire, backend="ffi")
    with pytest.raises(ValueError, match="backend='xla' only"):
        jaxcomm.diloco(
            optax.sgd(0.1), optax.sgd(1.0), "data", sync_every=2, wire_dtype=wire, backend="ffi"
        )
    with pytest.raises(ValueError, match="algorithm='ring'"):
        jaxcomm.allreduce_gradients("data", wire_dtype=wire, algorithm="ring")
    mesh = mesh_of((N,), ("data",))
    with pytest.raises(TypeError, match="as are int8 and int4"):
        run_sharded(
            lambda v: jaxcomm.reduce_scatter(v, "data", wire_dtype=wire),
            mesh,
            np.ones((N, 8), np.float32),
        )
