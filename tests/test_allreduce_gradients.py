"""allreduce_gradients against NumPy references on 8 CPU devices, 20 steps each."""

from __future__ import annotations

import importlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.harness import (
    OTHER_JOB,
    assert_same_on_all_devices,
    mesh_of,
    optax_on_mean,
    random_grads,
    run_steps,
    run_updates,
)
from tests.reference import direct_float32, error_bound

STEPS = 20
# Leaves of mixed sizes, including a scalar, a size not divisible by 8, and
# one smaller than the number of devices.
SHAPES = {"a_bias": (5,), "b_kernel": (33, 17), "c_scalar": (), "d_big": (4096,), "e_odd": (3,)}


@pytest.fixture
def mesh():
    return mesh_of((8,), ("data",))


def _params(shapes=SHAPES):
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _grads(seed=0, steps=STEPS, shapes=SHAPES, n=8, scale=1.0):
    return random_grads(np.random.default_rng(seed), shapes, n, steps, scale)


def _flat_reverse(tree) -> np.ndarray:
    """The single bucket of bucket_bytes=inf: leaves in reverse tree order."""
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.reshape(x, (x.shape[0], -1)) for x in reversed(leaves)], axis=1)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_dense_equals_optax_on_pmean_gradients(mesh, backend):
    grads = _grads()
    opt = optax.adam(1e-2)
    tx = optax.chain(jaxcomm.allreduce_gradients("data", backend=backend), opt)
    _, params, state = run_steps(tx, _params(), grads, mesh)
    want, want_state = optax_on_mean(opt, _params(), grads)
    for k in want:
        np.testing.assert_allclose(params[k][0], want[k], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(
        state[1][0].mu["d_big"][0], want_state[0].mu["d_big"], rtol=1e-5, atol=2e-7
    )
    assert_same_on_all_devices(params, "params")
    assert_same_on_all_devices(state, "state")


@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("wire", [jnp.float16, jnp.bfloat16])
def test_narrow_wire_replays_the_direct_schedule_bitwise(mesh, op, wire):
    """One bucket over ffi's direct schedule: each device sends
    cast(g_i / N), owners add in float32; NumPy replays it exactly."""
    grads = _grads(steps=3, scale=10.0)
    tx = jaxcomm.allreduce_gradients(
        "data", op=op, wire_dtype=wire, bucket_bytes=math.inf, backend="ffi", algorithm="direct"
    )
    updates, _, _ = run_steps(tx, _params(), grads, mesh)
    for g, u in zip(grads, updates, strict=True):
        want = direct_float32(_flat_reverse(g), np.dtype(wire), prescale=1 / 8)
        if op == "sum":
            want = want * np.float32(8)
        np.testing.assert_array_equal(_flat_reverse(u)[3], want)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_narrow_wire_within_stated_bound(mesh, backend):
    grads = _grads(steps=2)
    tx = jaxcomm.allreduce_gradients("data", wire_dtype=jnp.float16, backend=backend)
    updates, _, _ = run_steps(tx, _params(), grads, mesh)
    for g, u in zip(grads, updates, strict=True):
        xs = _flat_reverse(g)
        err = np.abs(_flat_reverse(u)[0] - xs.astype(np.float64).mean(0))
        # lax.psum (xla) adds in float16 too: the same bound covers it, as its
        # error is N adds of one float16 ulp of a partial sum.
        assert np.all(err <= error_bound(xs, "mean", np.float16, np.float32))


def test_error_feedback_residual_and_drift(mesh):
    """The residual is exactly what the cast dropped; with it, the summed
    updates drift from the summed true means by about one cast error instead
    of one per step. Devices hold large opposite values (which cancel in the
    mean), so each contribution's cast error is far above the result's own."""
    n = 8
    rng = np.random.default_rng(3)
    big = 1000.0 * rng.standard_normal((n, 512))
    big -= big.mean(0)  # cancels across devices
    grads = [{"w": (big + rng.standard_normal((n, 512))).astype(np.float32)} for _ in range(STEPS)]
    runs = {}
    for ef in (False, True):
        tx = jaxcomm.allreduce_gradients(
            "data", wire_dtype=jnp.float16, error_feedback=ef, backend="ffi", algorithm="direct"
        )
        runs[ef] = run_steps(tx, {"w": np.zeros(512, np.float32)}, grads, mesh)

    # Replay the residual in NumPy float32, step by step, on every device.
    e = np.zeros((n, 512), np.float32)
    for g in grads:
        v = g["w"] + e
        sent = (v * np.float32(1 / n)).astype(np.float16).astype(np.float32) * np.float32(n)
        e = v - sent
    np.testing.assert_array_equal(runs[True][2].residual.value["w"][:, 0], e)

    true_total = sum(g["w"].astype(np.float64).mean(0) for g in grads)
    drift = {ef: np.abs(sum(u["w"][0] for u in runs[ef][0]) - true_total).mean() for ef in runs}
    assert drift[True] < drift[False] / 3, drift


@pytest.mark.parametrize("backend,algorithm,scale", [("xla", "auto", 8), ("xla", "ring", 3)])
def test_error_feedback_residual_follows_the_prescale(backend, algorithm, scale):
    """The residual is what the collective's own cast dropped: lax.psum (xla
    auto) prescales a float16 mean over 3 devices by 1/8 (the headroom of
    _xla.headroom_scales), the ring by 1/3, and the two drop different bits."""
    n = 3
    rng = np.random.default_rng(4)
    grads = [{"w": (100.0 * rng.standard_normal((n, 256))).astype(np.float32)} for _ in range(3)]
    tx = jaxcomm.allreduce_gradients(
        "data", wire_dtype=jnp.float16, error_feedback=True, backend=backend, algorithm=algorithm
    )
    _, _, state = run_steps(tx, {"w": np.zeros(256, np.float32)}, grads, mesh_of((n,), ("data",)))

    def replay(s):
        e = np.zeros((n, 256), np.float32)
        for g in grads:
            v = g["w"] + e
            e = v - (v * np.float32(1 / s)).astype(np.float16).astype(np.float32) * np.float32(s)
        return e

    got = state.residual.value["w"][:, 0]
    np.testing.assert_array_equal(got, replay(scale))
    assert not np.array_equal(replay(8), replay(3))


@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("wire", [None, jnp.float16])
def test_double_buffering_is_dense_shifted_by_one_step(mesh, backend, wire):
    grads = _grads(steps=6)
    dense = jaxcomm.allreduce_gradients("data", backend=backend, wire_dtype=wire)
    db = jaxcomm.allreduce_gradients(
        "data", backend=backend, wire_dtype=wire, double_buffering=True
    )
    u_dense, _, _ = run_steps(dense, _params(), grads, mesh)
    u_db, _, _ = run_steps(db, _params(), grads, mesh)
    for k in SHAPES:
        np.testing.assert_array_equal(u_db[0][k], np.zeros_like(u_db[0][k]))
        for t in range(1, len(grads)):
            np.testing.assert_array_equal(u_db[t][k], u_dense[t - 1][k])


def test_double_buffer_holds_each_devices_own_gradient(mesh):
    """The buffer is per device: after the last step each row is that
    device's gradient plus the residual folded into it, and the residual is
    the one the run without double buffering holds one step earlier."""
    grads = _grads(steps=4)
    opts = dict(wire_dtype=jnp.float16, error_feedback=True)
    _, _, state = run_steps(
        jaxcomm.allreduce_gradients("data", double_buffering=True, **opts), _params(), grads, mesh
    )
    _, _, earlier = run_steps(
        jaxcomm.allreduce_gradients("data", **opts), _params(), grads[:-1], mesh
    )
    for k in SHAPES:
        residual = earlier.residual.value[k][:, 0]
        np.testing.assert_array_equal(state.residual.value[k][:, 0], residual)
        np.testing.assert_array_equal(state.buffer.value[k][:, 0], grads[-1][k] + residual)
    assert not np.array_equal(state.buffer.value["d_big"][0], state.buffer.value["d_big"][1])


def _entry(hlo: str) -> dict[str, str]:
    """The entry computation of `hlo` (optimized HLO text): each
    instruction's name and what follows its ``=``."""
    lines = hlo[hlo.index("\nENTRY ") + 1 :].split("\n}", 1)[0].splitlines()[1:]
    return dict(re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line).groups() for line in lines)


def _ancestors(entry: dict[str, str], name: str) -> set[str]:
    """The instructions of `entry` (from :func:`_entry`) that instruction
    `name` reads, directly or through others."""
    operands = {n: set(re.findall(r"%([\w.\-]+)", rhs)) & entry.keys() for n, rhs in entry.items()}
    todo, seen = [name], set()
    while todo:
        for dep in operands[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def _compiled_step(tx, mesh):
    """The entry computation of one compiled update step of `tx` on SHAPES,
    state carried by state_specs, and the index of the first parameter that
    is a gradient (parameters are the state's leaves, then the gradient's)."""
    with jax.set_mesh(mesh):
        state = tx.init({k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()})
    specs = jaxcomm.state_specs(state, "data")

    def step(state, g):
        return tx.update(jax.tree.map(lambda x: x[0], g), state)

    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs)),
        keep_unused=True,
    )
    rows = {
        k: jax.ShapeDtypeStruct((8, *s), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        for k, s in SHAPES.items()
    }
    return _entry(f.lower(state, rows).compile().as_text()), len(jax.tree.leaves(state))


def _reads_gradient(entry, first_grad: int, name: str) -> set[bool]:
    """For each parameter that instruction `name` reads: is it a gradient?"""
    params = re.findall(r"parameter\((\d+)\)", " ".join(entry[n] for n in _ancestors(entry, name)))
    return {int(i) >= first_grad for i in params}


@pytest.mark.parametrize(
    "backend,started,in_step,double_buffered",
    [
        ("ffi", False, 'custom_call_target="jaxcomm_allreduce', "same"),  # or _parts
        ("ffi", True, 'custom_call_target="jaxcomm_allreduce', '"jaxcomm_allreduce_done"'),
        ("xla", False, "all-reduce(", "same"),
    ],
)
def test_double_buffered_collective_does_not_read_the_steps_gradient(
    mesh, monkeypatch, backend, started, in_step, double_buffered
):
    """In the compiled step, the collective's operands come from the state
    alone: nothing the step's backward pass produces, so XLA may run it
    under the forward and backward passes. Without double buffering it
    reads the gradient. Started (ffi on CPU across processes, here forced
    in one), the collective ran from the previous step's end: this step
    only waits for it, on the handle."""
    monkeypatch.setattr(
        importlib.import_module("jaxcomm.collectives.reduction"), "START_IN_ONE_PROCESS", started
    )
    double_buffered = in_step if double_buffered == "same" else double_buffered
    reads = {}
    for db, collective in ((False, in_step), (True, double_buffered)):
        tx = jaxcomm.allreduce_gradients(
            "data",
            backend=backend,
            wire_dtype=jnp.float16,
            error_feedback=True,
            double_buffering=db,
        )
        entry, first_grad = _compiled_step(tx, mesh)
        calls = [n for n, rhs in entry.items() if collective in rhs]
        assert calls
        reads[db] = set().union(*(_reads_gradient(entry, first_grad, c) for c in calls))
    assert reads == {False: {False, True}, True: {False}}


def test_double_buffered_result_is_read_after_the_gradient_exists(mesh):
    """ffi on CPU: the collective's only reader is a jaxcomm_after call that
    also takes the step's gradient, so everything that reads the reduced
    gradient comes after the backward pass (and XLA cannot lend the result's
    memory to it, which would make the backward pass wait for the
    collective). Without double buffering there is nothing to hold."""
    for db in (False, True):
        tx = jaxcomm.allreduce_gradients("data", backend="ffi", bucket_bytes=0, double_buffering=db)
        entry, first_grad = _compiled_step(tx, mesh)
        calls = [n for n, rhs in entry.items() if 'custom_call_target="jaxcomm_allreduce"' in rhs]
        assert len(calls) == len(SHAPES)
        for call in calls:
            readers = [n for n, rhs in entry.items() if re.search(rf"%{re.escape(call)}\b", rhs)]
            held = [n for n in readers if 'custom_call_target="jaxcomm_after"' in entry[n]]
            assert held == (readers[:1] if db else []) and len(readers) >= 1
            if db:
                assert _reads_gradient(entry, first_grad, held[0]) == {False, True}
                assert "output_to_operand_aliasing" in entry[held[0]]  # no copy


def test_double_buffered_ffi_call_takes_the_buffer_as_it_is(mesh):
    """One leaf per bucket: each call's operand is the state's buffer itself
    (a parameter, seen through a bitcast), not a copy. A copy is work the
    call must wait for; reducing in place (the result taking the operand's
    buffer) would need one, since the step does not own its parameters."""
    tx = jaxcomm.allreduce_gradients(
        "data", backend="ffi", algorithm="direct", bucket_bytes=0, double_buffering=True
    )
    entry, _ = _compiled_step(tx, mesh)
    calls = [rhs for rhs in entry.values() if 'custom_call_target="jaxcomm_allreduce"' in rhs]
    assert len(calls) == len(SHAPES)
    for call in calls:
        operand = re.search(r"custom-call\(%([\w.\-]+)", call).group(1)
        while "bitcast(" in entry[operand]:
            operand = re.search(r"bitcast\(%([\w.\-]+)", entry[operand]).group(1)
        assert "parameter(" in entry[operand], entry[operand]
        assert "output_to_operand_aliasing" not in call


def test_started_result_is_read_after_the_gradient_exists(mesh, started_in_one_process):
    """ffi on CPU, started: what the done call returns (the result, and
    whether the exchange was found) has one reader each, a jaxcomm_after
    call that also takes the step's gradient, so everything that reads the
    reduced gradient comes after the backward pass (and XLA cannot lend
    their memory to it, which would make the backward pass wait for the
    exchange)."""
    tx = jaxcomm.allreduce_gradients("data", backend="ffi", bucket_bytes=0, double_buffering=True)
    entry, first_grad = _compiled_step(tx, mesh)
    calls = [n for n, rhs in entry.items() if 'custom_call_target="jaxcomm_allreduce_done"' in rhs]
    assert len(calls) == len(SHAPES)
    for call in calls:
        results = [n for n, rhs in entry.items() if f"get-tuple-element(%{call})" in rhs]
        assert len(results) == 2  # (result, found)
        for result in results:
            readers = [n for n, rhs in entry.items() if re.search(rf"%{re.escape(result)}\b", rhs)]
            assert len(readers) == 1 and 'custom_call_target="jaxcomm_after"' in entry[readers[0]]
            assert _reads_gradient(entry, first_grad, readers[0]) == {False, True}
            assert "output_to_operand_aliasing" in entry[readers[0]]  # no copy


def test_started_step_starts_the_next_exchange_on_the_gradient(mesh, started_in_one_process):
    """ffi on CPU, one leaf per bucket: the step starts the next step's
    exchange on the step's gradient itself (a parameter, seen through a
    bitcast; the handler copies it), and no collective runs in the step
    itself, outside the branch that reduces a restored state's buffer."""
    tx = jaxcomm.allreduce_gradients(
        "data", backend="ffi", algorithm="direct", bucket_bytes=0, double_buffering=True
    )
    entry, first_grad = _compiled_step(tx, mesh)
    starts = [
        rhs for rhs in entry.values() if 'custom_call_target="jaxcomm_allreduce_start"' in rhs
    ]
    assert len(starts) == len(SHAPES)
    for call in starts:
        operand = re.search(r"custom-call\(%([\w.\-]+)", call).group(1)
        while "bitcast(" in entry[operand]:
            operand = re.search(r"bitcast\(%([\w.\-]+)", entry[operand]).group(1)
        assert int(re.search(r"parameter\((\d+)\)", entry[operand]).group(1)) >= first_grad
    assert not [rhs for rhs in entry.values() if 'custom_call_target="jaxcomm_allreduce"' in rhs]


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_fused_equals_unfused(mesh, backend):
    grads = _grads(steps=4)
    out = {}
    for theta in (0, 2048, math.inf):
        tx = jaxcomm.allreduce_gradients("data", bucket_bytes=theta, backend=backend)
        out[theta] = run_steps(tx, _params(), grads, mesh)[0]
    for t in range(len(grads)):
        for k in SHAPES:
            for theta in (2048, math.inf):
                if backend == "ffi":  # the direct schedule adds each element in rank order
                    np.testing.assert_array_equal(out[theta][t][k], out[0][t][k])
                else:
                    np.testing.assert_allclose(out[theta][t][k], out[0][t][k], rtol=1e-6, atol=1e-7)


def _lowered(tx, mesh, shapes=SHAPES):
    state = tx.init({k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()})

    def step(state, g):
        return tx.update(jax.tree.map(lambda x: x[0], g), state)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
    rows = {
        k: jax.ShapeDtypeStruct((8, *s), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        for k, s in shapes.items()
    }
    return f.lower(state, rows)


@pytest.mark.parametrize("theta", [0, 2048, 20000, math.inf])
def test_one_collective_per_bucket(mesh, theta):
    """ffi: the compiled HLO has one custom call per bucket. xla: jaxcomm
    emits one all-reduce per bucket; XLA's CPU all-reduce combiner may then
    merge independent ones (it merges all of these), so the emitted module
    is the one counted."""
    planned = len(jaxcomm.plan_buckets([4 * math.prod(s) for s in SHAPES.values()], theta))
    tx = jaxcomm.allreduce_gradients("data", bucket_bytes=theta, backend="ffi")
    compiled = _lowered(tx, mesh).compile().as_text()
    assert compiled.count('custom_call_target="jaxcomm_allreduce') == planned

    tx = jaxcomm.allreduce_gradients("data", bucket_bytes=theta, backend="xla")
    emitted = _lowered(tx, mesh).as_text()
    assert len(re.findall(r"stablehlo\.all_reduce", emitted)) == planned


def _stats_of(tx, mesh, shapes=SHAPES):
    _, _, state = run_steps(tx, _params(shapes), _grads(steps=1, shapes=shapes), mesh)
    return jax.tree.map(lambda x: x[0], jaxcomm.get_stats(state))


def test_stats_count_the_payload_exactly(mesh):
    elements = sum(math.prod(s) for s in SHAPES.values())
    fp32 = _stats_of(jaxcomm.allreduce_gradients("data", bucket_bytes=0), mesh)
    fp16 = _stats_of(
        jaxcomm.allreduce_gradients("data", bucket_bytes=0, wire_dtype="float16"), mesh
    )
    assert fp32.payload_bytes == 4 * elements
    assert fp16.payload_bytes == 0.5 * fp32.payload_bytes
    assert fp32.bytes_sent == np.float32(4 * elements * 2 * 7 / 8)
    assert fp32.collectives == len(SHAPES) and fp32.density == 1 and not fp32.nonfinite

    hier = _stats_of(
        jaxcomm.allreduce_gradients(("node", "local"), algorithm="hierarchical"),
        mesh_of((2, 4), ("node", "local")),
    )
    # 2(L-1)/L inside the node plus 2(M-1)/M of the 1/L shard across nodes.
    assert hier.bytes_sent == np.float32(4 * elements * (2 * 3 / 4 + 2 * 1 / 2 / 4))


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_hierarchical_matches_the_mean(backend):
    mesh = mesh_of((2, 4), ("node", "local"))
    grads = _grads(steps=3)
    tx = jaxcomm.allreduce_gradients(
        ("node", "local"), algorithm="hierarchical", backend=backend, wire_dtype=jnp.bfloat16
    )
    updates, _, _ = run_steps(tx, _params(), grads, mesh)
    for g, u in zip(grads, updates, strict=True):
        xs = _flat_reverse(g)
        err = np.abs(_flat_reverse(u)[0] - xs.astype(np.float64).mean(0))
        assert np.all(err <= error_bound(xs, "mean", jnp.bfloat16, np.float32))
        assert_same_on_all_devices(u, "updates")


OPTIONS = [
    dict(),
    dict(wire_dtype=jnp.float16, error_feedback=True),
    dict(wire_dtype=jnp.bfloat16, double_buffering=True, bucket_bytes=0),
    dict(backend="ffi", algorithm="ring", bucket_bytes=math.inf, double_buffering=True),
    dict(backend="ffi", wire_dtype=jnp.float16, error_feedback=True, double_buffering=True),
    dict(backend="xla", algorithm="ring", op="sum", wire_dtype=jnp.float16),
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
)
def test_replicas_stay_bitwise_identical(mesh, options):
    tx = optax.chain(jaxcomm.allreduce_gradients("data", **options), optax.adam(1e-2))
    _, params, state = run_steps(tx, _params(), _grads(), mesh)
    assert_same_on_all_devices(params, "params")
    # Residuals are per device by definition (what each has not sent yet).
    shared = jax.tree.map(
        lambda x: None if isinstance(x, jaxcomm.PerDevice) else x,
        state,
        is_leaf=lambda x: isinstance(x, jaxcomm.PerDevice),
    )
    assert_same_on_all_devices(shared, "state")


@pytest.mark.parametrize("double_buffering", [False, True])
def test_nonfinite_gradient_is_flagged_everywhere_and_skippable(mesh, double_buffering):
    """One device's inf poisons the reduced gradient on all devices; the
    flag says so on all of them, the residual does not take it in, and
    optax.apply_if_finite after the transform skips the step everywhere.
    Double buffered, all of it happens one step later, when the gradient is
    reduced and returned."""
    grads = _grads(steps=4)
    grads[2]["d_big"][5, 7] = np.inf
    sgd = optax.sgd(0.1, momentum=0.9)
    opts = dict(wire_dtype=jnp.float16, error_feedback=True, double_buffering=double_buffering)
    tx = optax.chain(
        jaxcomm.allreduce_gradients("data", **opts),
        optax.apply_if_finite(sgd, max_consecutive_errors=3),
    )
    flags = []
    _, params, state = run_steps(
        tx,
        _params(),
        grads,
        mesh,
        check_vma=False,
        each_step=lambda _, s: flags.append(np.asarray(jaxcomm.get_stats(s).nonfinite)),
    )
    want_flags = [False] * len(grads)
    want_flags[2 + double_buffering] = True
    assert [bool(f.all()) for f in flags] == want_flags
    assert all(f.all() == f.any() for f in flags)  # every device agrees
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state[0].residual))
    # The same run without step 2 lands on the same parameters.
    skipped = grads[:2] + grads[3:]
    tx_ok = optax.chain(jaxcomm.allreduce_gradients("data", **opts), sgd)
    _, want, _ = run_steps(tx_ok, _params(), skipped, mesh, check_vma=False)
    for k in SHAPES:  # a different program (cond) may round the last bit differently
        np.testing.assert_allclose(params[k], want[k], rtol=1e-6, atol=1e-7)


def test_under_pmap():
    n = 8
    grads = _grads(steps=3)
    opt = optax.sgd(0.1, momentum=0.9)
    tx = optax.chain(jaxcomm.allreduce_gradients("i", wire_dtype=jnp.bfloat16), opt)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = jax.pmap(step, axis_name="i")
    p = jax.tree.map(lambda x: np.broadcast_to(x, (n, *x.shape)), _params())
    s = jax.pmap(tx.init, axis_name="i")(p)
    for g in grads:
        p, s = jax.block_until_ready(run(p, s, g))
    want, _ = optax_on_mean(opt, _params(), grads)
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(p[k])[3], want[k], rtol=1e-2, atol=1e-2)
    assert_same_on_all_devices(jax.tree.map(np.asarray, p), "params")


def test_error_feedback_state_through_shard_map_with_state_specs(mesh):
    """The documented way: init under jax.set_mesh, carry the state through
    shard_map with jaxcomm.state_specs; the residual rows stay per device."""
    tx = jaxcomm.allreduce_gradients("data", wire_dtype=jnp.float16, error_feedback=True)
    params = {"w": jnp.zeros(16)}
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")
    assert state.residual.value["w"].shape == (8, 16)

    def step(state, g):
        return tx.update({"w": g[0]}, state)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs)))
    g = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32) * 1e3
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    out, state = jax.block_until_ready(f(state, jax.device_put(g, NamedSharding(mesh, P("data")))))
    v = g.astype(np.float32)
    want = v - (v * np.float32(1 / 8)).astype(np.float16).astype(np.float32) * np.float32(8)
    np.testing.assert_array_equal(np.asarray(state.residual.value["w"]), want)


BAD = [
    (dict(op="max"), ValueError, "op='max'"),
    (dict(algorithm="tree"), ValueError, "algorithm='tree'"),
    (dict(backend="mpi"), ValueError, "backend='mpi'"),
    (dict(wire_dtype=jnp.int16), TypeError, "wire_dtype=int16"),
    (dict(bucket_bytes=-1), ValueError, "bucket_bytes=-1"),
    (dict(bucket_bytes="big"), TypeError, "bucket_bytes='big'"),
    (dict(error_feedback=True), ValueError, "error_feedback=True"),
    (dict(algorithm="hierarchical"), ValueError, "hierarchical"),
]


@pytest.mark.parametrize("options,error,message", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_options_fail_at_construction(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        jaxcomm.allreduce_gradients("data", **options)


def test_integer_gradients_are_refused(mesh):
    tx = jaxcomm.allreduce_gradients("data")
    with pytest.raises(TypeError, match=r"gradient\[.w.\] has dtype int32"):
        run_steps(tx, {"w": np.zeros(3, np.int32)}, [{"w": np.zeros((8, 3), np.int32)}], mesh)


def test_error_feedback_init_outside_a_mesh_says_how():
    tx = jaxcomm.allreduce_gradients("data", wire_dtype=jnp.float16, error_feedback=True)
    with pytest.raises(ValueError, match="jax.set_mesh"):
        tx.init({"w": jnp.zeros(3)})


def test_double_buffering_init_outside_a_mesh_names_the_buffer():
    tx = jaxcomm.allreduce_gradients("data", double_buffering=True)
    with pytest.raises(ValueError, match="keeps a per-device double buffer, .* jax.set_mesh"):
        tx.init({"w": jnp.zeros(3)})


def test_default_bucket_bytes_depends_on_the_backend(mesh):
    """xla: one collective per leaf (XLA's combiner fuses them without
    copies); ffi: the 4 MiB fusion plan (here everything fits in one bucket)."""
    xla = _stats_of(jaxcomm.allreduce_gradients("data", backend="xla"), mesh)
    ffi = _stats_of(jaxcomm.allreduce_gradients("data", backend="ffi"), mesh)
    assert xla.collectives == len(SHAPES)
    assert jaxcomm.transforms.DEFAULT_BUCKET_BYTES == 4 * 2**20 and ffi.collectives == 1


def test_check_finite_off_reports_nothing_and_reduces_the_same(mesh):
    grads = _grads(steps=2)
    grads[1]["d_big"][2, 3] = np.nan
    on = run_steps(jaxcomm.allreduce_gradients("data"), _params(), grads, mesh)
    off = run_steps(jaxcomm.allreduce_gradients("data", check_finite=False), _params(), grads, mesh)
    assert on[2].stats.nonfinite.all() and not off[2].stats.nonfinite.any()
    for k in SHAPES:
        np.testing.assert_array_equal(on[0][1][k], off[0][1][k])


def _layer_step(tx, mesh, width: int):
    """A step that takes a layer's gradient on each device's rows and
    exchanges it: a kernel of 8 x width and a 10-element bias on its first
    10 outputs (as a classifier's), whose gradient sums over the batch."""

    def loss(p, x):
        h = jnp.tanh(x @ p["kernel"])
        return jnp.sum(h) + jnp.sum(jnp.tanh(h[:, :10] + p["bias"]))

    def step(p, state, x):
        g = jaxcomm.local_grad(loss, "data")(p, x[0])
        return tx.update(g, state, p)

    params = {"kernel": jnp.ones((8, width)) / 8, "bias": jnp.zeros((10,))}
    state = tx.init(params)
    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )
    return f, params, state, jax.grad(loss)


@pytest.mark.parametrize("width", [16, 20000])
def test_a_bucket_of_a_layers_gradient_is_their_mean(mesh, width):
    """Kernel and bias in one bucket (the bias a reduction over the batch):
    the float64 mean of each device's gradient, for a kernel below and
    above the size at which a part is written into the bucket afterwards."""
    tx = jaxcomm.allreduce_gradients("data", bucket_bytes=math.inf, backend="xla")
    f, params, state, grad = _layer_step(tx, mesh, width)
    x = np.random.default_rng(0).standard_normal((8, 32, 8)).astype(np.float32)
    mean, _ = f(params, state, jax.device_put(x, NamedSharding(mesh, P("data"))))
    per_device = [jax.tree.map(np.float64, grad(params, x[d])) for d in range(8)]
    for k in params:
        expected = np.mean([g[k] for g in per_device], axis=0)
        np.testing.assert_allclose(mean[k], expected, rtol=1e-5, atol=1e-6)


def test_the_bucket_is_built_without_a_reduction_in_its_loop(mesh):
    """XLA's CPU compiler would fuse the bias's batch sum into the loop that
    builds the bucket (a concatenate) and compute it for every element of
    the bucket: seconds for a 16M-element bucket. The bucket is built by
    jaxcomm's pool call where the CPU handlers are built, else by a loop
    fusion; no loop fusion that writes a bucket-sized result holds a
    reduction (an in-place update of a part may: it runs over the part
    alone)."""
    tx = jaxcomm.allreduce_gradients("data", bucket_bytes=math.inf, backend="xla")
    f, params, state, _ = _layer_step(tx, mesh, 20000)
    rows = jax.ShapeDtypeStruct((8, 32, 8), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    hlo = f.lower(params, state, rows).compile().as_text()
    bucket = f"f32[{8 * 20000 + 10}]"
    builders = []
    for body in re.split(r"\n(?=%\S+ \()", hlo):  # one computation each
        root = re.search(r"ROOT %\S+ = (\S+) (\S+)\(", body)
        if root and root[1].startswith(bucket) and root[2] != "dynamic-update-slice":
            builders.append(body)
    pooled = re.search(rf"= {re.escape(bucket)}\S* custom-call\([^\n]*jaxcomm_pool", hlo)
    assert builders or pooled, "found nothing that builds the bucket"
    assert not [b.split(" ", 1)[0] for b in builders if re.search(r" reduce\(", b)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_through_a_bucket_is_that_through_leaves(mesh, dtype):
    """Differentiating a function of the exchanged gradient: one bucket
    (CPU: copied together by a custom call) and one collective per leaf
    give the same cotangents, the mean's transpose."""
    weights = {"kernel": np.arange(8 * 300, dtype=np.float32).reshape(8, 300) / 100, "bias": 2.0}

    def through(theta):
        tx = jaxcomm.allreduce_gradients("data", bucket_bytes=theta, backend="xla")

        def local(g):
            def f(g):
                mean, _ = tx.update(g, tx.init(g))
                return sum(jnp.sum(mean[k].astype(jnp.float32) * weights[k]) for k in mean)

            return jax.grad(f)(jax.tree.map(lambda x: x[0], g))

        run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        rows = {"kernel": jnp.ones((8, 8, 300), dtype), "bias": jnp.ones((8, 10), dtype)}
        return run(jax.device_put(rows, NamedSharding(mesh, P("data"))))

    fused, unfused = through(math.inf), through(0)
    for k in ("kernel", "bias"):
        np.testing.assert_array_equal(np.asarray(fused[k], np.float32), unfused[k])
        # Each device's rows get the weights / N; bfloat16 rounds them.
        mine = np.broadcast_to(np.float32(weights[k]) / 8, (8, 300) if k == "kernel" else (10,))
        expected = np.concatenate([mine] * 8)
        np.testing.assert_allclose(np.asarray(unfused[k], np.float32), expected, rtol=1e-2)


def _started_run(tx, grads, mesh, *, forget_at=None):
    """`tx`'s updates on each step's `grads` as users run them, and after
    each step how many more allreduces are in flight than before. At step
    `forget_at` the state's handles are made another job's (as in a state
    restored by a new process): that step must reduce the buffer it kept."""

    def forget(t, state):
        if t != forget_at:
            return state
        return state._replace(handles=[np.asarray(h) + OTHER_JOB for h in state.handles])

    updates, _, in_flight = run_updates(tx, _params(), grads, mesh, before_step=forget)
    return updates, in_flight


@pytest.mark.parametrize("wire,bucket_bytes", [(None, math.inf), (jnp.bfloat16, 0)])
def test_started_exchange_travels_between_steps(mesh, wire, bucket_bytes, started_in_one_process):
    """ffi on CPU: each step leaves its buffer's exchange in flight (one per
    bucket and device) for the next step to finish, and the result is the
    in-step delayed computation's, bitwise: dense's of the step before. A
    state whose exchange this job did not start (another job's handles)
    reduces its kept buffer in the step, to the same bits."""
    grads = _grads(steps=4)
    options = dict(backend="ffi", wire_dtype=wire, bucket_bytes=bucket_bytes)
    db = jaxcomm.allreduce_gradients("data", double_buffering=True, **options)
    dense, _, _ = run_steps(jaxcomm.allreduce_gradients("data", **options), _params(), grads, mesh)
    buckets = 1 if bucket_bytes else sum(1 for s in SHAPES.values() if math.prod(s))
    for forget_at in (None, 2):
        updates, in_flight = _started_run(db, grads, mesh, forget_at=forget_at)
        # Each step's exchange is in flight until the next step finishes it;
        # the one whose handles were replaced is never finished.
        left = [int(forget_at is not None and t >= forget_at) for t in range(len(grads))]
        assert in_flight == [(1 + x) * buckets * 8 for x in left]
        for k in SHAPES:
            np.testing.assert_array_equal(updates[0][k], np.zeros(SHAPES[k], np.float32))
            for t in range(1, len(grads)):
                np.testing.assert_array_equal(updates[t][k], dense[t - 1][k][0])  # rows alike
