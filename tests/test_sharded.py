"""Sharded models (HSDP): params sharded over "fsdp" inside a host,
replicated over "data" across hosts; jaxcomm reduces over "data" only and
keeps its state sharded like the params. Each transform against plain optax
on the exact global gradient (float64), on (data=2, fsdp=4) and (data=4,
fsdp=2) meshes, with the user's step a shard_map over both axes."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.distributed import collective_sequence
from tests import sharded_model as sm

# (data=4, fsdp=2) runs the same code on the other shape: in the slow tier.
MESHES = [(2, 4), pytest.param((4, 2), marks=pytest.mark.slow)]
STEPS = 3


def _close(params, want, rtol, atol):
    for k, ref in want.items():
        np.testing.assert_allclose(np.asarray(params[k]), ref, rtol=rtol, atol=atol, err_msg=k)


def _same_over_data(params):
    """Every copy of a shard (the data axis's replicas) is bitwise equal, and
    each param keeps the sharding it came in with."""
    for k, x in params.items():
        assert x.sharding.spec == sm.SPECS[k] or (k == "b" and not any(x.sharding.spec)), k
        copies = {}
        for shard in x.addressable_shards:
            key = str(shard.index)
            data = np.asarray(shard.data).tobytes()
            assert copies.setdefault(key, data) == data, f"{k}{key} differs over data"


# PowerSGD compressing from the first step every matrix its size rule
# takes, not its defaults' dense warm-up and embedding rule.
COMPRESS_ALL = dict(start_step=0, mask=None)


def _momentum():
    return optax.sgd(0.1, momentum=0.9)


# (id, transform, reference optimizer, delay, rtol/atol)
DENSE = [
    ("xla", lambda: optax.chain(jaxcomm.allreduce_gradients("data"), _momentum()), 0, 1e-5),
    (
        "bf16",  # auto: ffi on CPU, groups over "fsdp"
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", wire_dtype="bfloat16"), _momentum()
        ),
        0,
        2e-2,
    ),
    (
        "fp16_ef",
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", wire_dtype="float16", error_feedback=True),
            _momentum(),
        ),
        0,
        2e-3,
    ),
    (
        "fp8_ef_xla",
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", wire_dtype="float8_e4m3fn", error_feedback=True),
            _momentum(),
        ),
        0,
        1e-1,
    ),
    (
        "ffi_buckets",  # one call over a bucket of several shards
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", backend="ffi", bucket_bytes=1 << 20), _momentum()
        ),
        0,
        1e-5,
    ),
    (
        "ring_xla_buckets",
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", algorithm="ring", bucket_bytes=1 << 20),
            _momentum(),
        ),
        0,
        1e-5,
    ),
    (
        "double_buffering",
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", double_buffering=True), _momentum()
        ),
        1,
        1e-5,
    ),
]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_allreduce_gradients_on_a_sharded_model(shape, case):
    _, make, delay, tol = case
    params, state, data = sm.run(make(), sm.mesh(*shape), STEPS)
    _close(params, sm.reference(_momentum(), data, delay=delay), tol, tol * 0.1)
    _same_over_data(params)
    assert not bool(jaxcomm.get_stats(state).nonfinite)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
@pytest.mark.parametrize("fragments", [1, 3])
def test_diloco_on_a_sharded_model(shape, fragments):
    """sync_every=1 with an outer SGD of rate 1 averages the devices' inner
    steps: plain SGD on the mean gradient. Streaming (3 fragments, one a
    step) keeps the replicas equal and the params sharded."""
    tx = jaxcomm.diloco(
        optax.sgd(0.1), optax.sgd(1.0), "data", sync_every=fragments, fragments=fragments
    )
    params, _, data = sm.run(tx, sm.mesh(*shape), STEPS if fragments == 1 else fragments)
    if fragments == 1:
        _close(params, sm.reference(optax.sgd(0.1), data), 1e-5, 1e-6)
    _same_over_data(params)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
def test_diloco_overlapped_delay_on_a_sharded_model(shape):
    """A delayed sync started in its step and finished a step later (each
    fsdp shard its own exchange) lands what the in-step exchange lands."""
    runs = []
    for backend in ("auto", "xla"):
        tx = jaxcomm.diloco(
            optax.sgd(0.1), optax.sgd(1.0), "data", sync_every=2, delay=1, backend=backend
        )
        params, _, _ = sm.run(tx, sm.mesh(*shape), 7)  # syncs after steps 1, 3, 5; lands at 2, 4, 6
        runs.append(params)
        _same_over_data(params)
    _close(runs[0], jax.tree.map(np.asarray, runs[1]), 1e-6, 1e-7)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
def test_double_buffered_on_a_sharded_model(shape):
    """Each device's predicted params are its shards (P("data", *spec));
    the run matches the same transform on the whole params of a data-only
    mesh, whose devices take the same rows."""
    data, _ = shape

    def tx():
        return jaxcomm.double_buffered(optax.adamw(1e-2), "data", wire_dtype="bfloat16")

    params, state, _ = sm.run(tx(), sm.mesh(*shape), 4, local=True)
    want = sm.run_replicated(tx(), data, 4, local=True)
    _close(params, jax.tree.map(np.asarray, want), 1e-5, 1e-6)
    _same_over_data(params)
    for k, spec in sm.SPECS.items():
        want, got = ("data", *spec), tuple(state.local.value[k].sharding.spec)
        assert got[: len(want)] == want and not any(got[len(want) :]), (k, got)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
def test_powersgd_at_full_rank_is_dense(shape):
    """Rank min(rows, cols): P Q^T is the gradient itself (w1 split by rows,
    w2 by columns, b averaged densely)."""
    tx = optax.chain(
        jaxcomm.powersgd("data", rank=8, min_compression_rate=0.01, **COMPRESS_ALL), _momentum()
    )
    params, state, data = sm.run(tx, sm.mesh(*shape), STEPS)
    _close(params, sm.reference(_momentum(), data), 1e-4, 1e-5)
    _same_over_data(params)
    assert float(jaxcomm.get_stats(state).density) > 1  # both matrices compressed


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
@pytest.mark.parametrize("rank,warm_start", [(1, True), (2, False)])
def test_powersgd_sharded_matches_the_replicated_model(shape, rank, warm_start):
    """Low rank: the same compression, shard by shard, as on the whole
    params (the replicated run sees the same per-device gradients)."""

    def make():
        return optax.chain(
            jaxcomm.powersgd(
                "data",
                rank=rank,
                warm_start=warm_start,
                min_compression_rate=1.0,
                **COMPRESS_ALL,
            ),
            _momentum(),
        )

    params, _, _ = sm.run(make(), sm.mesh(*shape), STEPS)
    want = sm.run_replicated(make(), shape[0], STEPS)
    _close(params, {k: np.asarray(v) for k, v in want.items()}, 1e-4, 1e-6)
    _same_over_data(params)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_chunk_sparse_at_density_one_is_its_inner_optimizer(shape, backend):
    tx = jaxcomm.chunk_sparse(_momentum(), "data", density=1.0, chunk_size=8, backend=backend)
    params, state, data = sm.run(tx, sm.mesh(*shape), STEPS)
    _close(params, sm.reference(_momentum(), data), 1e-5, 1e-6)
    _same_over_data(params)
    assert float(jaxcomm.get_stats(state).density) == 1.0


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
def test_chunk_sparse_sparse_on_a_sharded_model(shape):
    """Each shard cuts its own pool (w1's and w2's shards) into chunks and
    picks its own mask, the same over "data"; the bias, whole on every
    shard, is averaged densely. With Adam inside: the replicas over data
    stay bitwise equal, each shard's mask agrees over data, and about the
    asked-for fraction of the pool travels."""
    tx = jaxcomm.chunk_sparse(optax.adam(1e-2), "data", density=0.25, chunk_size=2)
    params, state, _ = sm.run(tx, sm.mesh(*shape), 4)
    _same_over_data(params)
    assert state.mask.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    fsdp = shape[1]
    pool = (16 * 8 + 8 * 4) // fsdp  # this shard's elements of w1 and w2
    assert state.mask.shape == (fsdp, pool // 2)
    np.testing.assert_array_equal(np.asarray(state.mask).sum(1), pool // 2 // 4)
    density = float(jaxcomm.get_stats(state).density)
    assert density == pytest.approx((pool * 0.25 + 4) / (pool + 4))
    assert np.isfinite(np.asarray(params["w1"])).all()


def test_state_is_sharded_like_the_params():
    """Residuals, double buffers and DiLoCo's local params and inner state
    carry the params' own axes after the per-device rows."""
    m = sm.mesh(2, 4)
    txs = [
        jaxcomm.allreduce_gradients("data", wire_dtype="float16", error_feedback=True),
        jaxcomm.allreduce_gradients("data", double_buffering=True),
        jaxcomm.diloco(optax.sgd(0.1, momentum=0.9), optax.sgd(0.7), "data", sync_every=4),
    ]
    with jax.set_mesh(m):
        params = sm.place(sm.init_params(), m)
        for tx in txs:
            specs = jaxcomm.state_specs(tx.init(params), "data")
            leaves = jax.tree.leaves(
                specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
            )
            assert jax.sharding.PartitionSpec("data", "fsdp") in leaves, specs
            assert jax.sharding.PartitionSpec("data", None, "fsdp") in leaves, specs


def _step_hlo(tx, shape=(2, 4)):
    m = sm.mesh(*shape)
    with jax.set_mesh(m):
        params = sm.place(sm.init_params(), m)
        state = tx.init(params)
        step = sm.train_step(tx, m, jaxcomm.state_specs(state, "data"))
        x, y = jax.device_put(sm.batches(1)[0], NamedSharding(m, sm.ROWS))
        return collective_sequence(step.lower(params, state, x, y))


DATA_GROUPS = "replica_groups={{0,4},{1,5},{2,6},{3,7}}"


@pytest.mark.parametrize("wire,width", [(None, "f32"), ("bfloat16", "bf16")])
def test_only_the_local_shards_cross_the_data_axis(wire, width):
    """From the lowered step: the collectives over "data" carry this device's
    shards (4x8 of w1, 8x1 of w2, b), in the wire dtype; jaxcomm gathers
    nothing (the only all-gathers are the user's forward, one per sharded
    param); over "fsdp" it adds one scalar (the non-finite flag)."""
    tx = optax.chain(
        jaxcomm.allreduce_gradients("data", wire_dtype=wire, backend="xla"), optax.sgd(0.1)
    )
    hlo = _step_hlo(tx)
    over_data = [c for c in hlo if DATA_GROUPS in c]
    assert sorted(c.split()[1] for c in over_data) == sorted(
        [f"{width}[32]", f"{width}[8]", f"{width}[4]"]
    ), over_data
    assert all(c.startswith("all-reduce") for c in over_data)
    gathers = [c for c in hlo if c.startswith("all-gather")]
    assert sorted(c.split()[1] for c in gathers) == ["f32[16,8]", "f32[8,4]"], gathers
    ours = [c for c in hlo if c.startswith("all-reduce(maximum)")]
    assert [c.split()[1] for c in ours] == ["s32[]"], ours


def _device0_bytes(tree) -> int:
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for x in jax.tree.leaves(tree)
        for shard in x.addressable_shards
        if shard.device == device
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", wire_dtype="float16", error_feedback=True),
            optax.adam(1e-3),
        ),
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", double_buffering=True), _momentum()
        ),
        lambda: jaxcomm.diloco(
            optax.adam(1e-3), optax.sgd(0.7, momentum=0.9), "data", sync_every=4
        ),
    ],
    ids=["fp16_ef_adam", "double_buffering", "diloco"],
)
def test_memory_per_device_is_a_quarter_on_four_shards(make):
    """Params + optimizer state + jaxcomm state on one device of a (data=2,
    fsdp=4) mesh, sharded vs replicated, as placed; and the compiled step's
    arguments (memory_analysis) hold the sharded amount, batch aside."""
    m = sm.mesh(2, 4)
    params = sm.init_params(hidden=256)
    replicated = {k: jax.sharding.PartitionSpec() for k in params}
    tx = make()
    with jax.set_mesh(m):
        sharded = sm.place(params, m)
        whole = sm.place(params, m, replicated)
        per_device = _device0_bytes((sharded, tx.init(sharded)))
        full = _device0_bytes((whole, tx.init(whole)))
        state = tx.init(sharded)
        step = sm.train_step(tx, m, jaxcomm.state_specs(state, "data"))
        x, y = jax.device_put(sm.batches(1)[0], NamedSharding(m, sm.ROWS))
        compiled = step.lower(sharded, state, x, y).compile()
    assert 0.24 < per_device / full < 0.27, (per_device, full)
    # The compiled step's arguments: this device's batch rows and what is
    # placed, give or take the padding of a few scalars.
    arguments = compiled.memory_analysis().argument_size_in_bytes - (x.nbytes + y.nbytes) // 8
    assert abs(arguments - per_device) < 0.01 * per_device, (arguments, per_device)


def test_docs_sharded_step_runs_and_learns(capsys):
    """docs/sharded.md's step, run as written."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "sharded.md").read_text()
    guide_style, first_style, second_style = re.findall(r"```python\n(.*?)```", text, re.S)
    # The guides' style: an annotated NNX model with its own constraint
    # on "data", under data_parallel; it learns and keeps its placement.
    scope: dict = {}
    exec(compile(guide_style, "docs/sharded.md", "exec"), scope)
    assert "P(None, 'model')" in capsys.readouterr().out
    x = np.random.default_rng(3).standard_normal((256, 16)).astype(np.float32)
    y = np.tanh(x[:, :4])
    with jax.set_mesh(scope["mesh"]):
        fresh = scope["MLP"](scope["nnx"].Rngs(0))
        before = float(scope["loss_fn"](fresh, x, y))
        after = float(scope["loss_fn"](scope["model"], x, y))
    assert after < 0.5 * before, (before, after)
    scope = {}
    exec(compile(first_style, "docs/sharded.md", "exec"), scope)
    out = capsys.readouterr().out.split("\n")
    first, last = (float(line.split()[-1]) for line in out if line.startswith("step"))
    assert last < 0.5 * first, (first, last)
    assert "P('fsdp', None)" in out[2], out
    # The second style continues the first's session (its specs, rng),
    # from fresh params and a fresh optimizer.
    rng = np.random.default_rng(7)
    start = {
        "w1": 0.3 * rng.standard_normal((16, 32)).astype(np.float32),
        "w2": 0.3 * rng.standard_normal((32, 4)).astype(np.float32),
        "b": np.zeros(4, np.float32),
    }
    scope["params"] = start
    scope["tx"] = optax.chain(jaxcomm.allreduce_gradients("data"), optax.adam(1e-2))
    exec(compile(second_style, "docs/sharded.md", "exec"), scope)
    assert "P('fsdp', None)" in capsys.readouterr().out
    x = rng.standard_normal((256, 16)).astype(np.float32)
    y = np.tanh(x[:, :4])
    loss = scope["plain_loss"]
    trained = jax.tree.map(np.asarray, scope["params"])
    assert float(loss(trained, x, y)) < 0.5 * float(loss(start, x, y))


# The second style: every transform, the same references.
EXPLICIT = [
    ("dense", lambda: optax.chain(jaxcomm.allreduce_gradients("data"), _momentum()), 0, 1e-5),
    *[case for case in DENSE if case[0] != "xla"],
    (
        "powersgd_full_rank",
        lambda: optax.chain(
            jaxcomm.powersgd("data", rank=8, min_compression_rate=0.01, **COMPRESS_ALL), _momentum()
        ),
        0,
        1e-4,
    ),
    (
        "chunk_sparse_density_1",
        lambda: jaxcomm.chunk_sparse(_momentum(), "data", density=1.0, chunk_size=8),
        0,
        1e-5,
    ),
]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}_fsdp{s[1]}")
@pytest.mark.parametrize("case", EXPLICIT, ids=[c[0] for c in EXPLICIT])
def test_jit_with_an_explicit_fsdp_axis(shape, case):
    """jit over an Explicit mesh, shard_map manual over "data" only (Flax's
    sharding guide's style): each transform runs on the shards (a shard_map
    over "fsdp" inside it, moving nothing) and matches its reference."""
    _, make, delay, tol = case
    params, state, data = sm.run_explicit(make(), sm.explicit_mesh(*shape), STEPS)
    _close(params, sm.reference(_momentum(), data, delay=delay), tol, tol * 0.1)
    _same_over_data(params)


def test_diloco_with_an_explicit_fsdp_axis():
    tx = jaxcomm.diloco(optax.sgd(0.1), optax.sgd(1.0), "data", sync_every=1)
    params, _, data = sm.run_explicit(tx, sm.explicit_mesh(2, 4), STEPS)
    _close(params, sm.reference(optax.sgd(0.1), data), 1e-5, 1e-6)
    _same_over_data(params)


ALIKE = [
    (
        "chunk_sparse_adam",
        lambda: jaxcomm.chunk_sparse(optax.adam(1e-2), "data", density=0.25, chunk_size=2),
    ),
    (
        "powersgd_rank1",
        lambda: optax.chain(
            jaxcomm.powersgd("data", rank=1, min_compression_rate=1.0, **COMPRESS_ALL), _momentum()
        ),
    ),
    (
        "diloco_3_fragments",
        lambda: jaxcomm.diloco(optax.adam(1e-2), optax.sgd(0.7), "data", sync_every=3, fragments=3),
    ),
]


@pytest.mark.parametrize("case", ALIKE, ids=[c[0] for c in ALIKE])
def test_both_styles_train_alike(case):
    """Where no closed form exists (sparse masks, low rank, streaming
    syncs), the two styles run the same algorithm on the same gradients."""
    _, make = case
    a, _, _ = sm.run(make(), sm.mesh(2, 4), 4)
    b, _, _ = sm.run_explicit(make(), sm.explicit_mesh(2, 4), 4)
    _close(b, {k: np.asarray(v) for k, v in a.items()}, 1e-4, 1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.chain(
            jaxcomm.allreduce_gradients("data", wire_dtype="float16", error_feedback=True),
            optax.adam(1e-2),
        ),
        lambda: jaxcomm.chunk_sparse(optax.adam(1e-2), "data", density=0.25, chunk_size=2),
        lambda: optax.chain(
            jaxcomm.powersgd("data", rank=1, min_compression_rate=1.0, **COMPRESS_ALL), _momentum()
        ),
        lambda: jaxcomm.diloco(optax.adam(1e-2), optax.sgd(0.7), "data", sync_every=2),
    ],
    ids=["fp16_ef_adam", "chunk_sparse", "powersgd", "diloco"],
)
def test_orbax_restores_the_sharded_state_as_it_was(make, tmp_path):
    """The state goes to Orbax and back as it is placed (no respecifying):
    stopping after 2 steps and going on from the checkpoint ends bitwise
    where 4 uninterrupted steps end, the restored leaves sharded as saved."""
    import orbax.checkpoint as ocp

    m = sm.mesh(2, 4)
    tx = make()
    want, _, _ = sm.run(tx, m, 4)
    params, state, _ = sm.run(tx, m, 2)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step2", (params, state))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, (params, state))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "step2", abstract)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves((params, state)), strict=True):
        assert a.sharding == b.sharding
    got, _, _ = sm.run(tx, m, 4, start=restored, skip=2)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


@pytest.mark.parametrize("case", EXPLICIT[:1] + EXPLICIT[-2:], ids=lambda c: c[0])
def test_data_parallel_with_an_explicit_fsdp_axis(case):
    """The second style as jaxcomm.data_parallel writes it: a step written
    for jit, params sharded over an Explicit "fsdp" axis by their placement;
    the decorator's shard_map is manual over "data" only."""
    _, make, delay, tol = case
    tx, m = make(), sm.explicit_mesh(2, 4)

    @jaxcomm.data_parallel
    def step(params, opt_state, x, y):
        grads = jaxcomm.grad(sm.global_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    data = sm.batches(STEPS)
    with jax.set_mesh(m):
        params = sm.place(sm.init_params(0), m)
        opt_state = tx.init(params)
        for x, y in data:
            x, y = jax.device_put((x, y), NamedSharding(m, P("data")))
            params, opt_state = jax.block_until_ready(step(params, opt_state, x, y))
    assert params["w1"].sharding.spec == P("fsdp", None)  # still sharded
    _close(params, sm.reference(_momentum(), data, delay=delay), tol, tol * 0.1)
    _same_over_data(params)
