"""powersgd against a NumPy float64 replay of PowerSGD on 8 CPU devices.

The reference below is written from the paper's steps (Vogels et al. 2019,
as PyTorch DDP's hook runs them), not from the transform: its own
compression rule, orthonormalisation by QR, warm start, start_step and
error feedback, on per-device gradients that differ. The transform runs the
way users run it: init under ``jax.set_mesh``, state carried through
``jax.jit(jax.shard_map(...))`` with ``jaxcomm.state_specs``, replicated
outputs under ``P()``; every replicated output is compared across devices
bitwise after every step.
"""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import harness
from tests.harness import assert_same_on_all_devices, mesh_of, random_grads, run_steps

N = 8
ROOT = Path(__file__).resolve().parent.parent
STEPS = 20
# Tree order is key order. With rank 2 and the default rate 2:
# b_kernel, c_conv (viewed as 6 x 20), f_wide and g_edge (on the boundary:
# (8 + 8) * 2 * 2 == 64) are compressed; d_small and h_below ((7 + 8) * 4 > 56)
# are not, nor are the vector and the scalar.
SHAPES = {
    "a_bias": (5,),
    "b_kernel": (33, 17),
    "c_conv": (6, 2, 2, 5),
    "d_small": (3, 4),
    "e_scalar": (),
    "f_wide": (8, 64),
    "g_edge": (8, 8),
    "h_below": (7, 8),
}


@pytest.fixture(scope="module")
def mesh():
    return mesh_of((N,), ("data",))


# The algorithm as the reference replays it: compressed from the first step,
# every matrix the size rule takes. The defaults' warm-up, mask and rank are
# pinned by name in "Defaults" below.
ALGORITHM = dict(start_step=0, mask=None)


def _powersgd(axis="data", **options):
    return jaxcomm.powersgd(axis, **{**ALGORITHM, **options})


def _params(shapes=SHAPES):
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _grads(seed=0, steps=STEPS, shapes=SHAPES):
    return random_grads(np.random.default_rng(seed), shapes, N, steps)


# ---------------------------------------------------------------------------
# The reference, in float64.


def _is_compressed(shape, rank, rate) -> bool:
    if len(shape) < 2:
        return False
    rows, cols = shape[0], int(np.prod(shape[1:]))
    return (rows + cols) * rank * rate <= rows * cols


def _documented_draw(seed, step, sizes):
    """The Q draw the docstring promises: one float32 standard normal vector
    per step, cut in tree order into (cols, rank) blocks, row-major."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    flat = np.asarray(jax.random.normal(key, (sum(c * r for c, r in sizes),), jnp.float32))
    out, offset = [], 0
    for c, r in sizes:
        out.append(flat[offset : offset + c * r].reshape(c, r).astype(np.float64))
        offset += c * r
    return out


def _orthonormal(p):
    """Gram-Schmidt, column by column, each one taken twice against the
    earlier ones (twice is enough in float64); a column with nothing left
    becomes zero."""
    out = np.zeros_like(p)
    for i in range(p.shape[1]):
        c = p[:, i].copy()
        for _ in range(2):
            c -= out[:, :i] @ (out[:, :i].T @ c)
        norm = np.linalg.norm(c)
        out[:, i] = c / norm if norm > 0 else 0.0
    return out


def compressed_matrices(shapes, rank, rate) -> dict:
    """name -> (rows, cols, rank) of the leaves PowerSGD compresses, in tree order."""
    mats = {}
    for k, s in shapes.items():
        if _is_compressed(s, rank, rate):
            rows, cols = s[0], int(np.prod(s[1:]))
            mats[k] = (rows, cols, min(rank, rows, cols))
    return mats


def _draws(mats, seed, step) -> dict:
    draws = _documented_draw(seed, step, [(c, r) for _, c, r in mats.values()])
    return dict(zip(mats, draws, strict=True))


def reference_step(g, e, q, t, mats, *, start_step=0, error_feedback=True, warm_start=True,
                   seed=0):  # fmt: skip
    """Step t of PowerSGD from the devices' gradients g (one row each), their
    residuals e and the last Q: (mean gradient, new e, new Q)."""
    out = {k: v.astype(np.float64).mean(0) for k, v in g.items()}
    if t < start_step:
        return out, e, q
    fresh = _draws(mats, seed, t)
    e, q = dict(e), dict(q)
    for k, (rows, cols, _) in mats.items():
        m = g[k].astype(np.float64).reshape(N, rows, cols)
        if error_feedback:
            m = m + e[k]
        if warm_start:  # a column that came out zero is drawn afresh
            q0 = np.where(np.all(q[k] == 0, axis=0), fresh[k], q[k])
        else:
            q0 = fresh[k]
        p = _orthonormal((m @ q0).mean(0))
        q[k] = np.einsum("nrc,rk->nck", m, p).mean(0)
        approx = p @ q[k].T
        out[k] = approx.reshape(g[k].shape[1:])
        if error_feedback:
            e[k] = m - approx
    return out, e, q


def reference(grads_seq, *, rank, rate=2.0, seed=0, mats=None, **options):
    """PowerSGD run free over grads_seq: (mean gradients, final residuals, final
    Q); `mats` (name -> (rows, cols, rank)) overrides the one-rank rule."""
    if mats is None:
        shapes = {k: v.shape[1:] for k, v in grads_seq[0].items()}
        mats = compressed_matrices(shapes, rank, rate)
    e = {k: np.zeros((N, rows, cols)) for k, (rows, cols, _) in mats.items()}
    q, means = _draws(mats, seed, 0), []
    for t, g in enumerate(grads_seq):
        out, e, q = reference_step(g, e, q, t, mats, seed=seed, **options)
        means.append(out)
    return means, e, q


def momentum_sgd_step(mean, trace, lr=0.1, momentum=0.9):
    """optax.sgd(lr, momentum)'s update and new trace, in float64."""
    trace = {k: mean[k] + momentum * trace[k] for k in mean}
    return {k: -lr * v for k, v in trace.items()}, trace


def adam_step(mean, mu, nu, count, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    """optax.adam(lr)'s update and new moments after `count` steps, in float64."""
    t = count + 1
    mu = {k: b1 * mu[k] + (1 - b1) * mean[k] for k in mean}
    nu = {k: b2 * nu[k] + (1 - b2) * mean[k] ** 2 for k in mean}
    update = {k: -lr * (mu[k] / (1 - b1**t)) / (np.sqrt(nu[k] / (1 - b2**t)) + eps) for k in mean}
    return update, mu, nu


# ---------------------------------------------------------------------------
# Running the transform as users do.


def _replicated_bitwise(tree, what):
    """Every device's copy of each replicated output holds the same bits."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        shards = [np.asarray(s.data).tobytes() for s in x.addressable_shards]
        assert len(shards) == N and all(s == shards[0] for s in shards), (
            f"{what}{jax.tree_util.keystr(path)} differs between devices"
        )


def _shared_part(state):
    return jax.tree.map(
        lambda x: None if isinstance(x, jaxcomm.PerDevice) else x,
        state,
        is_leaf=lambda x: isinstance(x, jaxcomm.PerDevice),
    )


def run_as_users_do(tx, params, grads_seq, mesh):
    """Steps `tx` over `grads_seq` (each leaf one row per device); returns
    (updates per step, the state before the first step and after each, final
    params) as NumPy, after checking every replicated output bitwise across
    devices at every step."""
    states = []

    def check(p, state, u):
        _replicated_bitwise((p, u, _shared_part(state)), "replicated output ")
        states.append(jax.tree.map(np.asarray, state))

    with jax.set_mesh(mesh):
        states.append(jax.tree.map(np.asarray, tx.init(params)))
    updates, params, _ = harness.run_as_users_do(tx, params, grads_seq, mesh, each_step=check)
    return updates, states, params


def _psgd(state):
    """The powersgd state at the head of a chain."""
    return state[0]


# ---------------------------------------------------------------------------
# Step by step against the reference.

CONFIGS = {
    "rank2_momentum": dict(opts=dict(rank=2), opt="sgd"),
    "rank1_start5_cold_adam": dict(
        opts=dict(rank=1, start_step=5, warm_start=False, seed=3), opt="adam"
    ),
    "rank3_no_feedback_ffi": dict(
        opts=dict(rank=3, error_feedback=False, seed=7, backend="ffi"), opt="sgd"
    ),
    # rank clamped to min(rows, cols) = 3 for d_small: a lossless projection there.
    "rank4_low_rate": dict(opts=dict(rank=4, min_compression_rate=0.25), opt="adam"),
    # Two matrices the rule would compress kept dense by a mask: a full tree,
    # and a callable returning a prefix (one flag for the whole dict).
    "rank2_mask": dict(
        opts=dict(rank=2, mask={k: k not in ("b_kernel", "f_wide") for k in SHAPES}),
        opt="adam",
        dense=("b_kernel", "f_wide"),
    ),
    "rank2_mask_callable": dict(
        opts=dict(rank=2, mask=lambda tree: {k: k != "c_conv" for k in tree}),
        opt="sgd",
        dense=("c_conv",),
    ),
}


def _residuals(psgd_state, mats) -> dict:
    """The transform's residuals by leaf name, float64, as (devices, rows, cols)."""
    rows = psgd_state.residual.value if psgd_state.residual != () else ()
    return {
        k: np.asarray(r, np.float64).reshape(N, m[0], m[1])
        for (k, m), r in zip(mats.items(), rows, strict=False)
    }


def _qs(psgd_state, mats) -> dict:
    return {k: np.asarray(x, np.float64) for k, x in zip(mats, psgd_state.q, strict=False)}


def _close(have, want, what):
    """float32 against float64, within 1e-5 of the largest entry (about 80
    float32 ulps of it): the residual M - P Q^T cancels, and the last column
    of a full-rank P (d_small at rank 3, c_conv at rank 4) is ill-conditioned,
    so how XLA orders the sums moves it (jax 0.12 by 6e-6 where 0.10 did not)."""
    scale = max(1.0, float(np.abs(want).max(initial=0)))
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def _f64(tree) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def _optimizer_step(opt, mean, inner_state):
    """The reference optimizer's update, from the optimizer state the chain held."""
    if opt == "sgd":
        return momentum_sgd_step(mean, _f64(inner_state[0].trace))[0]
    adam_state = inner_state[0]
    return adam_step(mean, _f64(adam_state.mu), _f64(adam_state.nu), int(adam_state.count))[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_the_reference_step_by_step(mesh, name):
    """Each of 20 steps replayed in float64 from the state the transform
    held before it (so float32 rounding cannot build up over the power
    iterations): the updates after the optimizer, the residuals and Q."""
    opts, opt = CONFIGS[name]["opts"], CONFIGS[name]["opt"]
    grads = _grads()
    inner = optax.sgd(0.1, momentum=0.9) if opt == "sgd" else optax.adam(1e-2)
    tx = optax.chain(_powersgd(**opts), inner)
    updates, states, _ = run_as_users_do(tx, _params(), grads, mesh)

    mats = compressed_matrices(SHAPES, opts["rank"], opts.get("min_compression_rate", 2.0))
    for k in CONFIGS[name].get("dense", ()):
        assert k in mats  # the rule alone would compress it
        del mats[k]
    options = {
        k: opts[k] for k in ("start_step", "error_feedback", "warm_start", "seed") if k in opts
    }
    feedback, warm = opts.get("error_feedback", True), opts.get("warm_start", True)
    first = _psgd(states[0])
    assert (first.residual == ()) == (not feedback) and (first.q == ()) == (not warm)
    if warm:  # the documented first draw
        for k, want in _draws(mats, opts.get("seed", 0), 0).items():
            np.testing.assert_array_equal(_qs(first, mats)[k], want)

    for t in range(STEPS):
        before, after = states[t], states[t + 1]
        e, q = _residuals(before[0], mats), _qs(before[0], mats)
        mean, e, q = reference_step(grads[t], e, q, t, mats, **options)
        want = _optimizer_step(opt, mean, before[1])
        for k in SHAPES:
            _close(updates[t][k], want[k], f"step {t}, update of {k}")
        got = _psgd(after)
        assert int(got.count) == t + 1
        if feedback:
            assert [r.shape for r in got.residual.value] == [(N, *SHAPES[k]) for k in mats]
            if t < opts.get("start_step", 0):
                assert not any(r.any() for r in got.residual.value)  # dense steps keep none
        if warm:
            assert len(got.q) == len(mats)
        for name_, (have, ref) in {
            "residual": (_residuals(got, mats), e),
            "Q": (_qs(got, mats), q),
        }.items():
            for k in have:
                _close(have[k], ref[k], f"step {t}, {name_} of {k}")


def test_residual_is_what_the_approximation_missed(mesh):
    """Error feedback closes the books: summed over steps, the mean of what
    was applied plus the mean residual left is exactly the summed mean gradient."""
    grads = _grads(steps=6)
    updates, states, _ = run_as_users_do(_powersgd(rank=1), _params(), grads, mesh)
    compressed = [k for k, s in SHAPES.items() if _is_compressed(s, 1, 2.0)]
    assert len(compressed) == 5  # h_below too at rank 1
    residuals = states[-1].residual.value
    for k, e in zip(compressed, residuals, strict=True):
        applied = sum(u[k] for u in updates)
        true = sum(g[k].astype(np.float64).mean(0) for g in grads)
        np.testing.assert_allclose(applied + e.mean(0), true, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# What travels.


def _lowered(tx, mesh, shapes=SHAPES):
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    with jax.set_mesh(mesh):
        state = tx.init(params)
    run, specs = harness.user_step(tx, mesh, state)
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    rows = {
        k: jax.ShapeDtypeStruct((N, *s), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        for k, s in shapes.items()
    }
    return run.lower(params, state, rows)


# Elements per collective for SHAPES at rank 2: every P (rows x 2 of the four
# compressed leaves), every Q (cols x 2), and the dense leaves.
P_ELEMENTS = (33 + 6 + 8 + 8) * 2
Q_ELEMENTS = (17 + 20 + 64 + 8) * 2
DENSE_ELEMENTS = 5 + 12 + 1 + 56
ALL_ELEMENTS = sum(math.prod(s) for s in SHAPES.values())


def _all_reduce_sizes(compiled: str) -> list[int]:
    """Element counts of the operands of every all-reduce in compiled HLO."""
    sizes = []
    for line in compiled.splitlines():
        head = re.match(r"\s*%\S+ = (.*?) all-reduce\(", line)
        if head:
            sizes += [int(n) for n in re.findall(r"f32\[(\d+)\]", head.group(1))]
    return sorted(sizes)


def test_one_collective_for_p_one_for_q_one_dense(mesh):
    """jaxcomm emits three all-reduces. XLA's CPU combiner then merges the
    dense one into P's (they are independent; Q's needs P's result), so the
    compiled module holds two all-reduce ops carrying the same three
    operands. ffi custom calls are not combined: three of them."""
    tx = _powersgd(rank=2, backend="xla")
    lowered = _lowered(tx, mesh)
    assert len(re.findall(r"stablehlo\.all_reduce", lowered.as_text())) == 3
    compiled = lowered.compile().as_text()
    assert _all_reduce_sizes(compiled) == sorted([P_ELEMENTS, Q_ELEMENTS, DENSE_ELEMENTS])
    assert len(re.findall(r" all-reduce\(", compiled)) == 2

    ffi = _lowered(_powersgd(rank=2, backend="ffi"), mesh).compile().as_text()
    assert ffi.count('custom_call_target="jaxcomm_allreduce') == 3


def test_before_start_step_one_dense_collective_in_its_own_branch(mesh):
    """With start_step > 0 the step is a cond: one dense all-reduce of every
    leaf in the dense branch, the three of PowerSGD in the other."""
    lowered = _lowered(_powersgd(rank=2, start_step=3, backend="xla"), mesh)
    assert len(re.findall(r"stablehlo\.all_reduce", lowered.as_text())) == 4
    sizes = _all_reduce_sizes(lowered.compile().as_text())
    assert sizes == sorted([P_ELEMENTS, Q_ELEMENTS, DENSE_ELEMENTS, ALL_ELEMENTS])


def _stats_per_step(tx, mesh, steps):
    _, states, _ = run_as_users_do(tx, _params(), _grads(steps=steps), mesh)
    return [jaxcomm.get_stats(s) for s in states[1:]]


def test_stats_count_what_travels(mesh):
    sent = P_ELEMENTS + Q_ELEMENTS + DENSE_ELEMENTS
    dense, compressed = _stats_per_step(_powersgd(rank=2, start_step=1), mesh, 2)
    assert dense.payload_bytes == 4 * ALL_ELEMENTS and dense.collectives == 1
    assert dense.density == 1 and not dense.nonfinite
    assert compressed.payload_bytes == 4 * sent and compressed.collectives == 3
    assert compressed.bytes_sent == np.float32(4 * sent * 2 * 7 / 8)
    assert compressed.density == np.float32(sent / ALL_ELEMENTS)

    (fp16,) = _stats_per_step(_powersgd(rank=2, wire_dtype="float16"), mesh, 1)
    assert fp16.payload_bytes == 2 * sent and fp16.density == compressed.density

    (vectors,) = _stats_per_step(_powersgd(rank=2, min_compression_rate=math.inf), mesh, 1)
    assert vectors.collectives == 1 and vectors.payload_bytes == 4 * ALL_ELEMENTS


# ---------------------------------------------------------------------------
# Edge cases.


def test_zero_gradient_neither_nans_nor_sticks(mesh):
    """A zero gradient gives P = 0: its columns stay zero (no 0/0), the
    result is zero and so is the next Q. That Q's columns are drawn afresh
    at the next step, which then compresses as the reference does."""
    shapes = {"w": (16, 8)}
    grads = _grads(steps=4, shapes=shapes)
    grads[0]["w"][:] = 0
    updates, states, _ = run_as_users_do(_powersgd(rank=1), _params(shapes), grads, mesh)
    assert not updates[0]["w"].any() and not states[1].q[0].any()
    assert np.abs(updates[1]["w"]).max() > 0.1
    means, _, _ = reference(grads, rank=1)
    for t in range(4):
        np.testing.assert_allclose(updates[t]["w"], means[t]["w"], rtol=1e-5, atol=1e-5)


def test_dependent_column_of_p_becomes_zero(mesh):
    """M = e_0 v^T on every device: P = M Q has rows of zeros but the first,
    so its second column has nothing left after the first one (R's diagonal
    is exactly 0). It becomes zero, not NaN; the first column alone already
    gives M back, and the second column of Q comes out zero."""
    v = np.random.default_rng(2).standard_normal(8).astype(np.float32)
    m = np.zeros((16, 8), np.float32)
    m[0] = v
    grads = [{"w": np.broadcast_to(m, (N, 16, 8)).copy()}]
    tx = _powersgd(rank=2)
    updates, states, _ = run_as_users_do(tx, _params({"w": (16, 8)}), grads, mesh)
    np.testing.assert_allclose(updates[0]["w"], m, rtol=1e-6, atol=1e-6)
    q = states[1].q[0]
    assert np.isfinite(q).all() and q[:, 0].any() and not q[:, 1].any()


def test_nonfinite_gradient_is_flagged_everywhere_and_leaves_no_trace(mesh):
    """One device's inf reaches every device through P: the flag is set on
    all of them, powersgd's state stays as it was, and optax.apply_if_finite
    after it skips the step, landing where the run without it lands."""
    grads = _grads(steps=4)
    grads[2]["b_kernel"][5, 7, 3] = np.inf
    sgd = optax.sgd(0.1, momentum=0.9)
    tx = optax.chain(_powersgd(rank=2), optax.apply_if_finite(sgd, max_consecutive_errors=3))
    _, states, params = run_as_users_do(tx, _params(), grads, mesh)
    flags = [bool(jaxcomm.get_stats(s).nonfinite) for s in states[1:]]
    assert flags == [False, False, True, False]
    before, after = _psgd(states[2]), _psgd(states[3])
    for a, b in zip(
        jax.tree.leaves((before.residual, before.q, before.count)),
        jax.tree.leaves((after.residual, after.q, after.count)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))

    skipped = grads[:2] + grads[3:]
    _, _, want = run_as_users_do(optax.chain(_powersgd(rank=2), sgd), _params(), skipped, mesh)
    for k in SHAPES:  # a different program (cond) may round the last bit differently
        np.testing.assert_allclose(params[k], want[k], rtol=1e-6, atol=1e-6)


def test_under_pmap():
    steps = 3
    grads = _grads(steps=steps)
    tx = optax.chain(_powersgd("i", rank=2), optax.sgd(0.1))

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    run = jax.pmap(step, axis_name="i")
    p = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), _params())
    s = jax.pmap(tx.init, axis_name="i")(p)
    means, _, _ = reference(grads, rank=2)
    for t, g in enumerate(grads):
        p, s, u = jax.block_until_ready(run(p, s, g))
        u = jax.tree.map(np.asarray, u)
        assert_same_on_all_devices(u, "updates")
        for k in SHAPES:
            _close(u[k][3], -0.1 * means[t][k], f"step {t}, {k}")


def test_init_outside_a_mesh_says_how():
    with pytest.raises(ValueError, match="jax.set_mesh"):
        jaxcomm.powersgd("data").init({"w": jnp.zeros((16, 16))})


def _init_warnings(tx, params, mesh):
    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tx.init(params)
    return [str(w.message) for w in record if issubclass(w.category, UserWarning)]


HEAD = (
    "powersgd: no gradient leaf is compressed, so every step sends the whole gradient "
    "densely. A leaf is compressed where it is matrix-shaped and (rows + cols) * rank * "
    "min_compression_rate <= rows * cols "
)


def test_warns_when_no_leaf_is_compressed(mesh):
    """A small model: the 8x4 kernel's rank-2 factors, (8 + 4) * 2 = 24
    elements, are not twice smaller than its 32 (24 * 2 > 32), and the bias
    is not a matrix. Every step would go dense; init says why."""
    params = {"kernel": jnp.zeros((8, 4)), "bias": jnp.zeros(4)}
    assert _init_warnings(jaxcomm.powersgd("data", rank=2), params, mesh) == [
        HEAD + "(rank=2, min_compression_rate=2); the largest leaf, params['kernel'] of shape "
        "(8, 4), is not: as a 8 x 4 matrix its rank-2 factors, 24 elements, are not "
        "min_compression_rate=2 times smaller than its 32."
    ]


def test_warning_names_a_vector_or_a_masked_leaf(mesh):
    vector = {"w": jnp.zeros(1000), "b": jnp.zeros((2, 2))}
    assert _init_warnings(jaxcomm.powersgd("data"), vector, mesh)[0].endswith(
        "params['w'] of shape (1000,), is not: it is not matrix-shaped (ndim < 2)."
    )
    masked = {"emb": jnp.zeros((64, 64)), "b": jnp.zeros(4)}
    tx = jaxcomm.powersgd("data", mask={"emb": False, "b": True})
    assert _init_warnings(tx, masked, mesh)[0].endswith(
        "params['emb'] of shape (64, 64), is not: mask keeps it dense."
    )


def test_a_compressible_leaf_does_not_warn(mesh):
    """At the default rank 16 // 4 = 4, (16 + 16) * 4 * 2 = 256 <= 256: the
    kernel is compressed, so no warning, though the bias stays dense; an empty
    tree has nothing to warn about."""
    params = {"kernel": jnp.zeros((16, 16)), "bias": jnp.zeros(16)}
    assert _init_warnings(jaxcomm.powersgd("data"), params, mesh) == []
    assert _init_warnings(jaxcomm.powersgd("data"), {}, mesh) == []


# ---------------------------------------------------------------------------
# Options.

BAD = [
    (dict(rank=0), ValueError, "rank=0"),
    (dict(rank=1.5), ValueError, "rank=1.5"),
    (dict(rank=True), ValueError, "rank=True"),
    (dict(start_step=-1), ValueError, "start_step=-1"),
    (dict(start_step=2.0), ValueError, "start_step=2.0"),
    (dict(min_compression_rate=0), ValueError, "min_compression_rate=0"),
    (dict(min_compression_rate=-2.0), ValueError, "min_compression_rate=-2.0"),
    (dict(min_compression_rate=math.nan), ValueError, "min_compression_rate=nan"),
    (dict(min_compression_rate="2"), TypeError, "min_compression_rate='2'"),
    (dict(error_feedback="yes"), TypeError, "error_feedback='yes'"),
    (dict(warm_start=1), TypeError, "warm_start=1"),
    (dict(seed=-1), ValueError, "seed=-1"),
    (dict(seed=0.5), ValueError, "seed=0.5"),
    (dict(wire_dtype=jnp.int16), TypeError, "wire_dtype=int16"),
    (dict(algorithm="tree"), ValueError, "algorithm='tree'"),
    (dict(backend="mpi"), ValueError, "backend='mpi'"),
    (dict(mask="all"), ValueError, "mask='all' must be 'auto', None"),
    (dict(mask={"w": 1}), TypeError, "mask['w']=1 must be True or False"),
    (dict(mask={"w": [True, "no"]}), TypeError, "mask['w'][1]='no' must be True or False"),
]


@pytest.mark.parametrize("options,error,message", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_options_fail_at_construction(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        jaxcomm.powersgd("data", **options)


def test_mask_errors_name_the_leaf_or_the_structure(mesh):
    """What only the tree can tell: a callable's answer, and a mask that is
    not the gradients' structure or a prefix of it."""
    params = {"a": jnp.zeros((8, 8)), "b": {"c": jnp.zeros((8, 8))}}
    with jax.set_mesh(mesh):
        tx = jaxcomm.powersgd("data", mask=lambda tree: {"a": True, "b": {"c": 0}})
        with pytest.raises(TypeError, match=re.escape("mask(...)['b']['c']=0 must be True")):
            tx.init(params)
        tx = jaxcomm.powersgd("data", mask={"a": True, "z": False})
        with pytest.raises(ValueError, match="mask's structure .* is not the gradients'"):
            tx.init(params)
        # A prefix is enough: one flag for the whole of "b".
        state = jaxcomm.powersgd("data", rank=1, mask={"a": True, "b": False}).init(params)
        assert [q.shape for q in state.q] == [(8, 1)]


def test_docs_mask_example_keeps_the_embeddings_dense(mesh):
    """docs/powersgd.md's mask example, run as written."""
    text = (ROOT / "docs" / "powersgd.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "mask=" in b]
    scope = {"jax": jax, "jaxcomm": jaxcomm, "optax": optax}
    exec(code, scope)
    params = {
        "embed": jnp.zeros((256, 64)),
        "position": jnp.zeros((64, 64)),
        "kernel": jnp.zeros((64, 128)),
    }
    with jax.set_mesh(mesh):
        state = scope["tx"].init(params)
    assert [q.shape for q in _psgd(state).q] == [(128, 4)]  # only the kernel's


# ---------------------------------------------------------------------------
# Defaults: what jaxcomm.powersgd("data") compresses, at which rank, from when.

# A small transformer as Flax lays it out (kernels (in, out)), tree order =
# key order: the embedding (vocabulary 40 x width 16, tied to the output)
# and the position table (context 8) have first dimensions no other matrix
# has; every kernel's first dimension is a width some other matrix has too.
TRANSFORMER = {
    "a_embed": (40, 16),
    "b_position": (8, 16),
    "c_qkv": (16, 48),
    "d_out": (16, 16),
    "e_mlp_in": (16, 64),
    "f_mlp_out": (64, 16),
    "g_norm": (16,),
    "h_bias": (48,),
}


def numpy_auto_mask(shapes: dict) -> dict:
    """The docstring's rule: with two matrices or more, a matrix whose first
    dimension is no dimension of any other matrix stays dense."""
    matrices = [k for k, s in shapes.items() if len(s) >= 2]
    if len(matrices) < 2:
        return {k: True for k in shapes}
    return {
        k: len(s) < 2 or s[0] in {d for j in matrices if j != k for d in shapes[j]}
        for k, s in shapes.items()
    }


def numpy_default_rank(rows: int, cols: int) -> int:
    return min(max(1, min(rows, cols) // 4), rows, cols)


def default_matrices(shapes: dict, rate=2.0) -> dict:
    """name -> (rows, cols, rank) that the defaults compress, from the two rules."""
    mats = {}
    for k, s in shapes.items():
        if len(s) < 2 or not numpy_auto_mask(shapes)[k]:
            continue
        rows, cols = s[0], int(np.prod(s[1:]))
        r = numpy_default_rank(rows, cols)
        if (rows + cols) * r * rate <= rows * cols:
            mats[k] = (rows, cols, r)
    return mats


def test_default_choices_by_name(mesh):
    """The defaults on the small transformer: the embedding and the position
    table dense, every kernel compressed at min(rows, cols) // 4 = 4, and 50
    dense steps first."""
    defaults = {k: v.default for k, v in inspect.signature(jaxcomm.powersgd).parameters.items()}
    assert (defaults["rank"], defaults["start_step"], defaults["mask"]) == (None, 50, "auto")
    assert default_matrices(TRANSFORMER) == {
        "c_qkv": (16, 48, 4),
        "d_out": (16, 16, 4),
        "e_mlp_in": (16, 64, 4),
        "f_mlp_out": (64, 16, 4),
    }
    params = {k: jnp.zeros(s) for k, s in TRANSFORMER.items()}
    with jax.set_mesh(mesh):
        state = jaxcomm.powersgd("data").init(params)
    assert [q.shape for q in state.q] == [(48, 4), (16, 4), (64, 4), (16, 4)]
    assert [r.shape[1:] for r in state.residual.value] == [(16, 48), (16, 16), (16, 64), (64, 16)]


@pytest.mark.parametrize(
    "shapes",
    [
        # One matrix: nothing to compare its dimensions with, so compressed.
        {"kernel": (64, 32), "bias": (32,)},
        # An MLP over 20 input features: the first layer dense, the rest at
        # ranks 64 // 4 = 16 (on the size rule's boundary) and 10 // 4 = 2.
        {"w1": (20, 64), "w2": (64, 64), "w3": (64, 10), "b": (64,)},
        # Convolutions (kh, kw, in, out): their rows, kh = 3, recur in the
        # other kernel; compressed at rank 1.
        {"conv1": (3, 3, 8, 16), "conv2": (3, 3, 16, 32), "dense": (32, 40), "head": (40, 7)},
        # A width equal to the vocabulary: the embedding is then compressed.
        {"embed": (32, 32), "kernel": (32, 96)},
    ],
)
def test_default_rules_match_numpy(mesh, shapes):
    params = {k: jnp.zeros(s) for k, s in shapes.items()}
    with jax.set_mesh(mesh):
        state = jaxcomm.powersgd("data").init(params)
    want = default_matrices(shapes)
    assert want  # each case compresses something
    assert [q.shape for q in state.q] == [(c, r) for _, c, r in want.values()]


def test_defaults_match_the_reference_around_the_switch(mesh):
    """jaxcomm.powersgd("data") on the transformer, 53 steps: the 50 dense
    ones exactly the mean, then the reference's PowerSGD on the default
    matrices at their default ranks, from the Q drawn at step 0."""
    steps = 53
    grads = _grads(steps=steps, shapes=TRANSFORMER)
    updates, states, _ = run_as_users_do(
        jaxcomm.powersgd("data"), _params(TRANSFORMER), grads, mesh
    )
    mats = default_matrices(TRANSFORMER)
    means, _, _ = reference(grads, rank=None, mats=mats, start_step=50)
    for t in range(steps):
        for k in TRANSFORMER:
            _close(updates[t][k], means[t][k], f"step {t}, {k}")
    assert int(states[-1].count) == steps
    stats = jaxcomm.get_stats(states[50]), jaxcomm.get_stats(states[51])
    assert [int(s.collectives) for s in stats] == [1, 3]


def test_numpy_scalars_are_valid_options():
    jaxcomm.powersgd("data", rank=np.int64(2), start_step=np.int32(1), min_compression_rate=1.5,
                     error_feedback=np.bool_(True), seed=np.uint8(3))  # fmt: skip


@pytest.mark.slow
def test_building_starts_no_backend():
    """Built before jax.distributed.initialize, as the other transforms may be."""
    code = (
        "import jax.numpy as jnp, jaxcomm\n"
        "from jax._src import xla_bridge\n"
        "jaxcomm.powersgd('data', rank=4, start_step=10, wire_dtype=jnp.bfloat16)\n"
        "jaxcomm.powersgd(('node', 'data'), algorithm='hierarchical', backend='ffi')\n"
        "assert not xla_bridge.backends_are_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_state_carried_as_rows_and_16_bit_gradients(mesh):
    """The harness's way: every state leaf one row per device (so Q is typed
    as varying, and the dense and compressed branches must agree on it), and
    bfloat16 gradients, whose factors are computed in float32 while the
    result and the residual keep bfloat16."""
    shapes = {"b": (16,), "w": (32, 16)}
    grads = _grads(steps=4, shapes=shapes)
    tx = optax.chain(_powersgd(rank=2, start_step=2), optax.sgd(0.1))
    updates, params, state = run_steps(tx, _params(shapes), grads, mesh)
    assert_same_on_all_devices(params, "params")
    means, _, _ = reference(grads, rank=2, start_step=2)
    for t in range(4):
        for k in shapes:
            _close(updates[t][k][5], -0.1 * means[t][k], f"step {t}, {k}")

    bf16 = [{k: v.astype(jnp.bfloat16) for k, v in g.items()} for g in grads]
    params16 = {k: v.astype(jnp.bfloat16) for k, v in _params(shapes).items()}
    updates, _, state = run_steps(_powersgd(rank=2), params16, bf16, mesh)
    assert updates[-1]["w"].dtype == jnp.bfloat16 and updates[-1]["b"].dtype == jnp.bfloat16
    assert state.residual.value[0].dtype == jnp.bfloat16 and state.q[0].dtype == np.float32
    means, _, _ = reference(
        [{k: v.astype(np.float32) for k, v in g.items()} for g in bf16[:1]], rank=2
    )
    np.testing.assert_allclose(
        updates[0]["w"][0].astype(np.float32), means[0]["w"], rtol=2e-2, atol=2e-2
    )


def test_checkpoint_round_trip(mesh, tmp_path):
    """Saved with Orbax after 3 steps and restored into a fresh init, the
    state (per-device residuals, Q, counter, the optimizer's) goes on to
    end 6 steps bitwise where the run without the stop ends."""
    grads = _grads(steps=6)
    tx = optax.chain(_powersgd(rank=2, start_step=1), optax.adam(1e-2))
    with jax.set_mesh(mesh):
        state = tx.init(_params())
    run, specs = harness.user_step(tx, mesh, state)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    rows = NamedSharding(mesh, P("data"))

    def steps(p, state, gs):
        for g in gs:
            p, state, _ = jax.block_until_ready(run(p, state, jax.device_put(g, rows)))
        return p, state

    start = (jax.device_put(_params(), NamedSharding(mesh, P())), jax.device_put(state, shardings))
    whole = steps(*start, grads)
    half = steps(*start, grads[:3])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step3", {"params": half[0], "state": half[1]})
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "step3", {"params": start[0], "state": start[1]})
    assert int(_psgd(restored["state"]).count) == 3
    resumed = steps(restored["params"], restored["state"], grads[3:])
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
