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

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.harness import mesh_of, random_grads

N = 8
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


def reference(grads_seq, *, rank, rate=2.0, seed=0, **options):
    """PowerSGD run free over grads_seq: (mean gradients, final residuals, final Q)."""
    mats = compressed_matrices({k: v.shape[1:] for k, v in grads_seq[0].items()}, rank, rate)
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


def _user_step(tx, mesh, state):
    specs = jaxcomm.state_specs(state, "data")

    def step(params, state, g):
        g = jax.tree.map(lambda x: x[0], g)  # this device's gradient
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, updates

    run = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs, P())
        )
    )
    return run, specs


def run_as_users_do(tx, params, grads_seq, mesh):
    """Steps `tx` over `grads_seq` (each leaf one row per device); returns
    (updates per step, the state before the first step and after each, final
    params) as NumPy, after
    checking every replicated output bitwise across devices at every step."""
    with jax.set_mesh(mesh):
        state = tx.init(params)
    run, specs = _user_step(tx, mesh, state)
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    rows = NamedSharding(mesh, P("data"))
    updates, states = [], [jax.tree.map(np.asarray, state)]
    for g in grads_seq:
        p, state, u = jax.block_until_ready(run(p, state, jax.device_put(g, rows)))
        _replicated_bitwise((p, u, _shared_part(state)), "replicated output ")
        updates.append(jax.tree.map(np.asarray, u))
        states.append(jax.tree.map(np.asarray, state))
    return updates, states, jax.tree.map(np.asarray, p)


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
    """float32 against float64, up to a few float32 ulps of the largest entry:
    the residual M - P Q^T cancels, and the last column of a full-rank P
    (d_small at rank 3) is ill-conditioned."""
    scale = max(1.0, float(np.abs(want).max(initial=0)))
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=5e-6 * scale, err_msg=what)


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
    tx = optax.chain(jaxcomm.powersgd("data", **opts), inner)
    updates, states, _ = run_as_users_do(tx, _params(), grads, mesh)

    mats = compressed_matrices(SHAPES, opts["rank"], opts.get("min_compression_rate", 2.0))
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
    updates, states, _ = run_as_users_do(jaxcomm.powersgd("data", rank=1), _params(), grads, mesh)
    compressed = [k for k, s in SHAPES.items() if _is_compressed(s, 1, 2.0)]
    assert len(compressed) == 5  # h_below too at rank 1
    residuals = states[-1].residual.value
    for k, e in zip(compressed, residuals, strict=True):
        applied = sum(u[k] for u in updates)
        true = sum(g[k].astype(np.float64).mean(0) for g in grads)
        np.testing.assert_allclose(applied + e.mean(0), true, rtol=1e-4, atol=1e-4)
