"""Float16 wire overflow: a prescale plus a saturating wire, or a prescale with headroom where
XLA adds in float16, keeps finite gradients finite.

The requirement: FP16 wire casting must never turn finite gradients into inf for
any N up to 1024 while |g| <= M = 65504, the float16 maximum. Float16 rounds
v to inf iff |v| >= 65520 = M + 16 (half an ulp above M; the tie goes to the
even neighbour, 2^16).

Prescaling alone is not enough. Each device's p_i = fl32(g_i * fl32(1/N))
has |p_i| <= (M/N)(1 + 2^-24)^2, so any float32 sum of the p_i is below
65509 < 65520; but what travels is float16: direct and lax.psum send
fl16(p_i), the ring sends fl16 of every partial sum, and each rounding may go
up by a relative 2^-11, M * 2^-11 = 32 > 16, the headroom:

- direct, N = 3: M/3 = 21834.67; float16 spacing in [2^14, 2^15) is 16, so
  fl16(M/3) = 21840, and the float32 sum 3 * 21840 = 65520 rounds to inf.
- ring, N = 10: p = 6550.4; the partial sums sent are 6552, 13104, 19648,
  26192, 32736, 39296, 45856, 52416, 58976, and 58976 + 6550.4 = 65526.4
  rounds to inf.

So jaxcomm's schedules saturate (ReduceSpec::saturate, _xla.saturate): a
prescaled partial sum is clamped to +-M before it is rounded to the wire;
inf and NaN pass. The exact mean lies within [-M, M], so the clamp only
removes rounding excess and the result stays within the float16 error bound.
A plain sum (op="sum" on the collective, no prescale) is not clamped: its
overflow is real and comes back as inf.

Every step is monotone (float32 multiply and add, the clamp, the float16
cast), so the result only grows with the inputs: every device at +M is the
worst case for +inf (and -M for -inf), and one evaluation per N decides every
input below M. The sweep replays the schedules for every N in 2..1024.

What jaxcomm cannot clamp: lax.psum and lax.psum_scatter add in float16
inside XLA (xla "auto" and "hierarchical", the xla reduce_scatter), where the
1/N prescale overflows at N = 3 as direct does. There a float16 mean is
prescaled by 2^-k instead, 2^k the least power of two >= 2N, and 2^k/N is
applied in float32 after the reduction (_xla.headroom_scales): every term is
at most M/(2N), so the exact sum of any subset is at most M/2, and N - 1
float16 additions in any order inflate it by at most (1 + 2^-11)^(N-1) < 1.65
for N <= 1024, so no partial sum reaches M. XLA's order cannot be replayed:
the headroom sweep checks, in NumPy float16, a left-to-right and a
pairwise-tree order for every N in 2..1024 (for a fixed order all devices at
+M is again the worst case; values near +-M are tried too) and that 1/N
overflows in both at N = 3; the devices run N in {2, 3, 4, 8}.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import reference

import jaxcomm
from jaxcomm.collectives import _xla
from tests.harness import assert_same_on_all_devices as assert_replicated
from tests.harness import mesh_of, run_sharded, run_steps

F16, F32 = np.float16, np.float32
M = float(np.finfo(F16).max)  # 65504
BELOW_M = float(np.nextafter(F16(M), F16(0)))  # 65472, one float16 ulp below M
BELOW_M_F32 = float(np.nextafter(F32(M), F32(0)))  # just below M, not a float16 value
ROUNDS_TO_INF = M + 16  # 65520: half a float16 ulp (32 at 2^15..2^16) above M
HIER_SHAPE = {2: (2, 1), 3: (1, 3), 4: (2, 2), 8: (2, 4)}  # (inter, intra), as in test_allreduce


def _f16(x):
    with np.errstate(over="ignore"):
        return np.asarray(x, F32).astype(F16).astype(F32)


def near_max_rows(n: int, rng) -> np.ndarray:
    """(n, 8 * n) float32: column blocks of n columns each, one per pattern.

    Every device at +M, at -M, just below M in float32 and in float16; +M
    and -M alternating over devices (both phases); random magnitudes in
    [M/2, M) and M itself, each with one random sign per column.
    """
    alternating = np.where(np.arange(n)[:, None] % 2 == 0, M, -M)
    random = rng.uniform(M / 2, M, (n, n)) * rng.choice([-1.0, 1.0], n)
    blocks = [
        np.full((n, n), M),
        np.full((n, n), -M),
        np.full((n, n), BELOW_M_F32),
        np.full((n, n), BELOW_M),
        np.broadcast_to(alternating, (n, n)),
        np.broadcast_to(-alternating, (n, n)),
        random,
        np.full((n, n), M) * rng.choice([-1.0, 1.0], n),
    ]
    return np.concatenate(blocks, axis=1).astype(F32)


def _mesh(n: int, algorithm: str):
    if algorithm == "hierarchical":
        return mesh_of(HIER_SHAPE[n], ("inter", "intra")), ("inter", "intra")
    return mesh_of((n,), ("i",)), "i"


SCHEDULES = [
    ("xla", "auto"),
    ("xla", "ring"),
    ("xla", "hierarchical"),
    ("ffi", "ring"),
    ("ffi", "direct"),
    ("ffi", "hierarchical"),
]


def _device_cases():
    for n in (2, 3, 4, 8):
        for backend, algorithm in SCHEDULES:
            yield pytest.param(n, backend, algorithm, id=f"n{n}-{backend}-{algorithm}")


@pytest.mark.parametrize("n,backend,algorithm", list(_device_cases()))
def test_float16_mean_near_max_is_finite_on_devices(n, backend, algorithm):
    """Every device at or just below the float16 maximum: the mean over a
    float16 wire is finite, replicated, and within the stated float16 bound of
    the float64 mean."""
    xs = near_max_rows(n, np.random.default_rng(n))
    mesh, axes = _mesh(n, algorithm)
    out = run_sharded(
        lambda x: jaxcomm.allreduce(
            x, axes, op="mean", wire_dtype=jnp.float16, backend=backend, algorithm=algorithm
        ),
        mesh,
        xs,
    )
    assert_replicated(out)
    bad = np.flatnonzero(~np.isfinite(out[0]))
    assert bad.size == 0, f"non-finite at columns {bad.tolist()}"
    err = np.abs(out[0].astype(np.float64) - reference.allreduce64(xs, "mean"))
    assert np.all(err <= reference.error_bound(xs, "mean", F16, F32))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_reduce_scatter_float16_mean_near_max_is_finite(n, backend):
    """reduce_scatter (xla: lax.psum_scatter) at and near the float16 maximum:
    each device's slice is finite and within the float16 bound of the float64 mean."""
    xs = near_max_rows(n, np.random.default_rng(30 + n))
    out = run_sharded(
        lambda x: jaxcomm.reduce_scatter(
            x, "i", op="mean", wire_dtype=jnp.float16, backend=backend
        ),
        mesh_of((n,), ("i",)),
        xs,
    )
    got = out.reshape(-1)[: xs.shape[1]]  # slice r of rank r, in rank order
    bad = np.flatnonzero(~np.isfinite(got))
    assert bad.size == 0, f"non-finite at columns {bad.tolist()}"
    err = np.abs(got.astype(np.float64) - reference.allreduce64(xs, "mean"))
    assert np.all(err <= reference.error_bound(xs, "mean", F16, F32))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_allreduce_gradients_float16_near_max(n, backend, op):
    """allreduce_gradients prescales a narrow wire for op='sum' too and scales
    back in float32: a sum of N values near M exceeds the float16 maximum but
    comes back finite as the float32 N * mean, and nothing is flagged."""
    xs = near_max_rows(n, np.random.default_rng(10 + n))
    tx = jaxcomm.allreduce_gradients("data", op=op, wire_dtype=jnp.float16, backend=backend)
    updates, _, state = run_steps(
        tx, {"g": np.zeros(xs.shape[1], F32)}, [{"g": xs}], mesh_of((n,), ("data",))
    )
    got = updates[0]["g"]
    assert_replicated(got)
    assert np.isfinite(got).all() and not state.stats.nonfinite.any()
    err = np.abs(got[0].astype(np.float64) - reference.allreduce64(xs, op))
    assert np.all(err <= reference.error_bound(xs, op, F16, F32))
    if op == "sum":
        assert np.abs(got[0]).max() > M  # the float32 result holds what float16 could not


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("backend,algorithm", [("xla", "ring"), ("ffi", "ring"), ("ffi", "direct")])
def test_numpy_replay_is_bitwise_the_library_near_max(n, backend, algorithm):
    """The replays that the N <= 1024 sweep relies on give bitwise the
    library's result (overflows included) on inputs at and near M."""
    xs = near_max_rows(n, np.random.default_rng(20 + n))
    mesh = mesh_of((n,), ("i",))
    out = run_sharded(
        lambda x: jaxcomm.allreduce(
            x, "i", op="mean", wire_dtype=jnp.float16, backend=backend, algorithm=algorithm
        ),
        mesh,
        xs,
    )
    replay = reference.direct_float32 if algorithm == "direct" else reference.ring_float32
    with np.errstate(over="ignore"):
        want = replay(xs, F16, prescale=1.0 / n)
    np.testing.assert_array_equal(out[0].view(np.uint32), want.view(np.uint32))


# The sweep: every device holds the same value g (the worst case, see the
# module docstring), so one element per N suffices; these replay
# reference.ring_float32 / direct_float32 for equal rows, vectorized over N.
NS = np.arange(2, 1025)


def _clamp(v, saturate: bool):
    return np.clip(v, -M, M) if saturate else v


def ring_equal_rows(g: float, ns=NS, *, saturate=True) -> np.ndarray:
    """Float32 result of the float16-wire ring mean over n devices all holding g
    (finite g); saturate=False replays the schedule without the clamp."""
    p = F32(g) * (1.0 / ns).astype(F32)
    partial = p.copy()
    for hop in range(2, int(ns.max()) + 1):
        partial = np.where(hop <= ns, p + _f16(_clamp(partial, saturate)), partial)
    return _f16(_clamp(partial, saturate))


def direct_equal_rows(g: float, ns=NS, *, saturate=True) -> np.ndarray:
    """Float32 result of the float16-wire direct mean over n devices all holding g."""
    sent = _f16(F32(g) * (1.0 / ns).astype(F32))
    total = sent.copy()
    for rank in range(1, int(ns.max())):
        total = np.where(rank < ns, total + sent, total)
    return _f16(_clamp(total, saturate))


SWEEPS = {
    "ring": (ring_equal_rows, reference.ring_float32),
    "direct": (direct_equal_rows, reference.direct_float32),
}


@pytest.mark.parametrize("schedule", sorted(SWEEPS))
def test_sweep_equals_the_replay(schedule):
    sweep, replay = SWEEPS[schedule]
    ns = np.array([2, 3, 5, 10, 16, 100, 127])
    for g in (M, BELOW_M, BELOW_M_F32, 1000.0):
        got = sweep(g, ns)
        with np.errstate(over="ignore"):
            want = [replay(np.full((n, 1), g, F32), F16, prescale=1.0 / n)[0] for n in ns]
        np.testing.assert_array_equal(got.view(np.uint32), np.array(want, F32).view(np.uint32))


def _overflowing(values: np.ndarray, ns=NS) -> list:
    return ns[~np.isfinite(values)].tolist()


@pytest.mark.parametrize("g", [M, BELOW_M, BELOW_M_F32])
@pytest.mark.parametrize("schedule", sorted(SWEEPS))
def test_float16_mean_never_overflows_up_to_1024(schedule, g):
    """The no-overflow requirement, for every N in 2..1024 at the worst case; and the
    result is the float64 mean within the float16 bound (the clamp removes
    rounding excess only)."""
    values = SWEEPS[schedule][0](g)
    bad = _overflowing(values)
    assert not bad, f"{len(bad)} of {NS.size} N overflow, first {bad[:10]}"
    for n, value in zip(NS, values, strict=True):
        bound = reference.error_bound(np.full((n, 1), g, F32), "mean", F16, F32)
        assert abs(float(value) - g) <= bound[0], (n, value)


@pytest.mark.parametrize("schedule", sorted(SWEEPS))
def test_without_the_clamp_the_sweep_overflows(schedule):
    """The clamp is what holds the claim: the same replay without it overflows
    (from N = 10 on the ring, N = 3 direct, as in the docstring)."""
    sweep = SWEEPS[schedule][0]
    bad = _overflowing(sweep(M, saturate=False))
    assert bad and bad[0] == {"ring": 10, "direct": 3}[schedule]


@pytest.mark.parametrize("schedule", sorted(SWEEPS))
def test_float16_mean_powers_of_two_up_to_1024_never_overflow(schedule):
    ns = 2 ** np.arange(1, 11)
    values = SWEEPS[schedule][0](M, ns)
    assert not _overflowing(values, ns)
    if schedule == "direct":  # fl16(M/N) = M/N exactly, and so is the float32 sum N * (M/N)
        np.testing.assert_array_equal(values, M)


def test_hand_worked_overflows():
    """The two examples of the module docstring, step by step, unclamped."""
    assert _f16(F32(M) * F32(1 / 3)) == 21840 and 3 * 21840 == ROUNDS_TO_INF
    assert direct_equal_rows(M, np.array([3]), saturate=False)[0] == np.inf
    assert direct_equal_rows(M, np.array([3]))[0] == M
    p = F32(M) * F32(1 / 10)
    sent, partial = [], p
    for _ in range(9):
        sent.append(float(_f16(partial)))
        partial = p + _f16(partial)
    assert sent == [6552, 13104, 19648, 26192, 32736, 39296, 45856, 52416, 58976]
    assert partial >= ROUNDS_TO_INF
    assert ring_equal_rows(M, np.array([10]), saturate=False)[0] == np.inf
    assert ring_equal_rows(M, np.array([10]))[0] == M


# The headroom sweep for the paths where XLA adds in float16 (lax.psum,
# lax.psum_scatter). Rows of G are devices: N devices hold G[:N]. Columns:
# +M, -M, just below M in float16 and in float32, magnitudes in [M/2, M)
# all positive, all negative, and with random signs.
def _near_max_pool(rows: int = int(NS.max())) -> np.ndarray:
    rng = np.random.default_rng(7)
    fixed = np.broadcast_to([M, -M, BELOW_M, BELOW_M_F32], (rows, 4))
    signs = np.concatenate(
        [np.ones((rows, 8)), -np.ones((rows, 8)), rng.choice([-1.0, 1.0], (rows, 8))], axis=1
    )
    return np.concatenate([fixed, rng.uniform(M / 2, M, (rows, 24)) * signs], axis=1).astype(F32)


def _headroom(n: int) -> tuple[float, float]:
    return _xla.headroom_scales(F16, n, 1.0 / n, 1.0)


def _one_over_n(n: int) -> tuple[float, float]:
    return 1.0 / n, 1.0


def _terms(g: np.ndarray, prescale: float) -> np.ndarray:
    """What travels, as _xla.to_wire casts: fl16(fl32(g) * prescale)."""
    with np.errstate(over="ignore"):
        return (g.astype(F32) * np.asarray(prescale, F32)).astype(F16)


def chain_sums(pool: np.ndarray, scales, ns=NS) -> np.ndarray:
    """Float16 sums t_1 + t_2 + ... + t_N, left to right, of the first N rows
    of `pool`; one row per N in `ns`."""
    pre = np.array([scales(int(n))[0] for n in ns], F32)[:, None]  # one row per N
    total = _terms(pool[0][None], pre)
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(1, int(ns.max())):
            step = total + _terms(pool[j][None], pre)
            total = np.where((j < ns)[:, None], step, total)
    return total


def tree_sums(pool: np.ndarray, scales, ns=NS) -> np.ndarray:
    """Float16 sums of the first N rows of `pool` in a pairwise tree
    ((t1 + t2) + (t3 + t4)) + ..., an odd one out carried up a level."""
    out = []
    with np.errstate(over="ignore", invalid="ignore"):
        for n in ns:
            level = _terms(pool[:n], scales(int(n))[0])
            while level.shape[0] > 1:
                half = level.shape[0] // 2
                pairs = level[0 : 2 * half : 2] + level[1 : 2 * half : 2]
                level = np.concatenate([pairs, level[2 * half :]])
            out.append(level[0])
    return np.stack(out)


ORDERS = {"chain": chain_sums, "tree": tree_sums}


def test_headroom_scales_leave_room_for_any_order():
    """The bound of _xla.headroom_scales for every N in 2..1024: the prescale
    is 2^-k with 2N <= 2^k < 4N, the terms at most M/2^k (a float16 value),
    their exact sum at most M/2, and (1 + 2^-11)^(N-1) times that below M;
    the two scales together are still 1/N."""
    for n in NS:
        pre, post = _headroom(int(n))
        power = 1.0 / pre
        assert power == 2.0 ** round(np.log2(power)) and 2 * n <= power < 4 * n, n
        assert float(F16(M / power)) == M / power
        assert n * (M / power) <= M / 2
        assert (1 + 2.0**-11) ** (n - 1) * (n * M / power) < M
        assert post == pytest.approx(power / n, rel=1e-15)
        assert pre * post == pytest.approx(1.0 / n, rel=1e-15)


def test_headroom_only_for_a_float16_mean():
    """bfloat16 (float32's range), wide wires and a plain sum keep their scales."""
    assert _xla.headroom_scales(jnp.bfloat16, 3, 1 / 3, 1.0) == (1 / 3, 1.0)
    assert _xla.headroom_scales(F32, 3, 1 / 3, 1.0) == (1 / 3, 1.0)
    assert _xla.headroom_scales(F16, 3, 1.0, 1.0) == (1.0, 1.0)
    assert _xla.headroom_scales(F16, 3, 1.0, 1 / 3) == (1.0, 1 / 3)
    assert _xla.headroom_scales(F16, 3, 1 / 3, 1.0) == (1 / 8, 8 / 3)


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_headroom_sums_never_overflow_up_to_1024(order):
    """No N in 2..1024 overflows in this order, at or near +-M; scaled back
    by 2^k/N in float32, the sum is the float64 mean within the float16 bound."""
    pool = _near_max_pool()
    sums = ORDERS[order](pool, _headroom)
    bad = NS[~np.isfinite(sums).all(axis=1)].tolist()
    assert not bad, f"{len(bad)} of {NS.size} N overflow, first {bad[:10]}"
    for n, total in zip(NS, sums, strict=True):
        got = total.astype(F32) * F32(_headroom(int(n))[1])
        err = np.abs(got.astype(np.float64) - reference.allreduce64(pool[:n], "mean"))
        assert np.all(err <= reference.error_bound(pool[:n], "mean", F16, F32)), n


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_one_over_n_prescale_overflows_in_both_orders(order):
    """What the sweep would find with 1/N: N = 3 (every device at M) is the
    first to overflow, 21840 + 21840 + 21840 = 65520."""
    sums = ORDERS[order](np.full((8, 1), M, F32), _one_over_n, np.arange(2, 9))
    assert np.arange(2, 9)[~np.isfinite(sums[:, 0])].tolist()[0] == 3


@pytest.mark.parametrize(
    "backend,algorithm", [("xla", "auto"), ("xla", "ring"), ("ffi", "ring"), ("ffi", "direct")]
)
def test_a_real_float16_overflow_of_a_sum_stays_inf(backend, algorithm):
    """op="sum" on the collective is not prescaled and not clamped (nor given
    headroom on lax.psum): 4 * 40000 exceeds the float16 range, and the
    result says so instead of a finite lie."""
    xs = np.full((4, 6), 40000.0, F32)
    out = run_sharded(
        lambda x: jaxcomm.allreduce(
            x, "i", op="sum", wire_dtype=jnp.float16, backend=backend, algorithm=algorithm
        ),
        mesh_of((4,), ("i",)),
        xs,
    )
    assert np.isposinf(out).all()


# One device's non-finite gradient, on the schedules the existing test
# (test_allreduce_gradients: xla auto, +inf, error feedback) does not use.
NONFINITE = {
    "+inf on device 1": [(1, np.inf)],
    "-inf on device 1": [(1, -np.inf)],
    "nan on device 1": [(1, np.nan)],
    "+inf and -inf on devices 0 and 2": [(0, np.inf), (2, -np.inf)],
}


@pytest.mark.parametrize("case", sorted(NONFINITE))
@pytest.mark.parametrize("backend,algorithm", [("xla", "ring"), ("ffi", "ring"), ("ffi", "direct")])
def test_nonfinite_on_one_device_is_reported_everywhere(case, backend, algorithm):
    """The flag is set on every device, only the poisoned element is
    non-finite, with the IEEE sign (inf - inf is nan), and the others are the
    mean within the bound."""
    n, size, at = 4, 10, 7
    xs = np.random.default_rng(3).uniform(-M, M, (n, size)).astype(F32)
    for device, value in NONFINITE[case]:
        xs[device, at] = value
    tx = jaxcomm.allreduce_gradients(
        "data", wire_dtype=jnp.float16, backend=backend, algorithm=algorithm
    )
    updates, _, state = run_steps(
        tx, {"g": np.zeros(size, F32)}, [{"g": xs}], mesh_of((n,), ("data",))
    )
    got = updates[0]["g"]
    assert state.stats.nonfinite.all()
    with np.errstate(invalid="ignore"):
        want_at = xs[:, at].astype(np.float64).sum()  # the IEEE result: inf, -inf or nan
    np.testing.assert_array_equal(got[:, at], np.full(n, want_at, F32))
    rest = np.delete(np.arange(size), at)
    err = np.abs(got[0, rest] - reference.allreduce64(xs[:, rest], "mean"))
    assert np.all(err <= reference.error_bound(xs[:, rest], "mean", F16, F32))


# 8-bit wires (jaxcomm/collectives/_fp8.py): each device's scale maps its own
# largest |x| to at most the format's largest value, so the cast never
# overflows; what can is float32 itself, near its largest value: a decoded
# value that rounded up past it (clamped back), and a mean over N devices
# that is not a power of two, where fl(1/N) > 1/N (the rows are scaled by
# 2^-k first, so their sum cannot overflow; the rounding excess is clamped).
F32_MAX = float(np.finfo(F32).max)
FP8 = {"float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}  # unit roundoff


@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 8])
@pytest.mark.parametrize("wire", sorted(FP8))
def test_fp8_mean_near_float32_max_is_finite_on_devices(n, wire):
    rng = np.random.default_rng(n)
    alternating = np.where(np.arange(n)[:, None] % 2 == 0, F32_MAX, -F32_MAX)
    xs = np.concatenate(
        [
            np.full((n, 4), F32_MAX),
            np.full((n, 4), -F32_MAX),
            np.full((n, 4), np.nextafter(F32(F32_MAX), F32(0))),
            np.broadcast_to(alternating, (n, 4)),
            rng.uniform(F32_MAX / 2, F32_MAX, (n, 8)) * rng.choice([-1.0, 1.0], 8),
        ],
        axis=1,
    ).astype(F32)
    out = run_sharded(
        lambda x: jaxcomm.allreduce(x, "i", op="mean", wire_dtype=wire), mesh_of((n,), ("i",)), xs
    )
    assert_replicated(out)
    assert np.all(np.isfinite(out)), out[0]
    u = FP8[wire]
    err = np.abs(out[0].astype(np.float64) - reference.allreduce64(xs, "mean"))
    assert np.all(err <= (2 * u + u * u) * F32_MAX * (1 + 1e-5))


@pytest.mark.parametrize("wire", sorted(FP8))
def test_a_real_float32_overflow_of_an_fp8_sum_is_not_finite(wire):
    """A sum (not clamped) that exceeds float32 comes back inf, or NaN where
    the format has no inf to carry it (float8_e4m3fn): never a finite lie."""
    xs = np.full((4, 6), F32_MAX / 2, F32)
    out = run_sharded(
        lambda x: jaxcomm.allreduce(x, "i", op="sum", wire_dtype=wire), mesh_of((4,), ("i",)), xs
    )
    if wire == "float8_e5m2":
        assert np.isposinf(out).all()
    else:
        assert np.isnan(out).all()
