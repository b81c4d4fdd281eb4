"""The CPU FFI transport: peers that never arrive, leaks, mismatched calls.

Some of these drive the C++ collective code through the test-only module
jaxcomm._ffi_testing (run_threads: one std::thread per rank, no XLA), which
can stage what an XLA program cannot: a rank that never shows up. That module
links its own copy of the CPU transport, so its timeout and live slots are
set and counted there, apart from jaxcomm._ffi's.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import _ffi as ext
from jaxcomm import _ffi_testing as harness
from tests.harness import mesh_of, run_sharded, sharded_runner

RING, HIERARCHICAL, DIRECT = 0, 1, 2
F32 = 0


@pytest.fixture
def short_timeout():
    old = jaxcomm.get_ffi_timeout()
    jaxcomm.set_ffi_timeout(0.5)
    yield
    jaxcomm.set_ffi_timeout(old)


@pytest.fixture
def short_harness_timeout():
    old = harness.get_timeout()
    harness.set_timeout(0.5)
    yield
    harness.set_timeout(old)


def test_default_timeout_is_60_seconds():
    assert jaxcomm.get_ffi_timeout() == 60.0


@pytest.mark.parametrize("algorithm,intra", [(RING, 1), (DIRECT, 1), (HIERARCHICAL, 2)])
def test_threads_match_numpy(algorithm, intra):
    rng = np.random.default_rng(algorithm)
    xs = rng.standard_normal((8, 999)).astype(np.float32)
    outs = harness.run_threads(list(xs), F32, algorithm, intra_size=intra)
    for out in outs:
        np.testing.assert_allclose(out, xs.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm,intra", [(RING, 1), (DIRECT, 1), (HIERARCHICAL, 2)])
def test_absent_ranks_are_named_within_the_timeout(short_harness_timeout, algorithm, intra):
    xs = [np.ones(16, np.float32)] * 8
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        harness.run_threads(xs, F32, algorithm, intra_size=intra, absent=[2, 5])
    elapsed = time.monotonic() - start
    assert elapsed < 5.0
    message = str(info.value)
    if algorithm == HIERARCHICAL:
        # Ranks 2 and 5 are local ranks 0 and 1 of nodes 1 and 2.
        assert re.search(r"ranks \[\d(, \d)*\] of \d did not arrive", message), message
    else:
        assert "ranks [2, 5] of 8 did not arrive" in message, message
    assert harness.live_slots() == 0


def test_no_slot_left_after_10000_calls():
    xs = [np.full(3, r, np.float32) for r in range(4)]
    for _ in range(10_000):
        outs = harness.run_threads(xs, F32, DIRECT)
    np.testing.assert_array_equal(outs[0], np.full(3, 6.0, np.float32))
    assert harness.live_slots() == 0


def test_no_slot_left_after_jitted_calls():
    mesh = mesh_of((8,), ("i",))
    xs = np.ones((8, 5), np.float32)
    run = sharded_runner(lambda x: jaxcomm.allreduce(x, "i", backend="ffi"), mesh)
    for _ in range(200):  # one step in flight at a time (the runner blocks)
        out = run(xs)
    np.testing.assert_array_equal(out[0], np.full(5, 8.0))
    assert ext.live_slots() == 0


def test_repeated_op_in_a_loop():
    """The same call site runs many times in one execution (a scan): rounds
    of one op id must not mix up, whatever order the devices arrive in."""
    mesh = mesh_of((8,), ("i",))
    xs = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)

    def fn(x):
        def body(carry, _):
            carry = jaxcomm.allreduce(carry, "i", op="mean", backend="ffi")
            return carry * 2.0 + jax.lax.axis_index("i"), None

        return jax.lax.scan(body, x, None, length=20)[0]

    out = run_sharded(fn, mesh, xs)
    want = xs.astype(np.float64)
    for _ in range(20):
        want = want.mean(0, keepdims=True) * 2.0 + np.arange(8)[:, None]
    np.testing.assert_allclose(out, want, rtol=1e-5)


def test_device_that_skips_the_collective_gives_an_error(short_timeout):
    """A collective under a condition that differs between devices: the
    devices that arrive fail with an error naming the ones that did not."""
    mesh = mesh_of((4,), ("i",))

    def fn(x):
        rank = jax.lax.axis_index("i")

        def reduced(v):
            return jax.lax.pcast(jaxcomm.allreduce(v, "i", backend="ffi"), "i", to="varying")

        return jax.lax.cond(rank < 2, reduced, lambda v: v, x)

    with pytest.raises(Exception, match=r"ranks \[2, 3\] of 4 did not arrive"):
        run_sharded(fn, mesh, np.ones((4, 3), np.float32))
    assert ext.live_slots() == 0
    # The transport is usable again afterwards.
    out = run_sharded(
        lambda x: jaxcomm.allreduce(x, "i", backend="ffi"), mesh, np.ones((4, 3), np.float32)
    )
    np.testing.assert_array_equal(out[0], np.full(3, 4.0))


def test_mismatched_calls_are_detected():
    """Ranks disagreeing on the chunk mask (which must be identical) fail
    fast with an error instead of corrupting memory or hanging."""
    mesh = mesh_of((2,), ("i",))

    def fn(x):
        rank = jax.lax.axis_index("i")
        mask = jnp.array([True, False]) | (rank == 1)
        return jaxcomm.allreduce(x, "i", backend="ffi", chunk_mask=mask, chunk_size=4)

    with pytest.raises(Exception, match="different sizes, dtypes, options or chunk masks"):
        run_sharded(fn, mesh, np.ones((2, 8), np.float32))
    assert ext.live_slots() == 0


def test_float16_wire_round_trip_is_exact_rne():
    """The C++ float16 / bfloat16 casts agree with NumPy / ml_dtypes on every
    16-bit pattern (through a 1-rank ... 2-rank ring whose partner sends 0)."""
    import ml_dtypes

    for wire, code in [(np.float16, 1), (np.dtype(ml_dtypes.bfloat16), 2)]:
        bits = np.arange(2**16, dtype=np.uint16)
        values = bits.view(wire).astype(np.float32)
        finite = np.isfinite(values)
        # Perturb by less than half an ulp in both directions: RNE must undo it.
        xs = [values[finite] * np.float32(1 + 2**-13), np.zeros(finite.sum(), np.float32)]
        outs = harness.run_threads(xs, F32, DIRECT, wire=code)
        want = xs[0].astype(wire).astype(np.float32)
        np.testing.assert_array_equal(outs[0], want)
    assert reference.EPS  # reference module importable alongside


def test_float16_wire_edges_in_vector_and_scalar_code():
    """Overflow, infinities, NaN, and the subnormal and rounding boundaries,
    as NumPy casts them: 8 at a time (the F16C path where the CPU has it) and
    in the tail after the last full 8 (the scalar path)."""
    edges = np.array(
        [65504, 65519.996, 65520, 1e6, np.inf, -np.inf, np.nan, -65520,
         2**-14, 2**-14 * (1 - 2**-11), 2**-24, 2**-25, 2**-25 * 1.0001, 3 * 2**-26, 1e-10, -0.0,
         1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2049, 2051, 0.1, -7.5, 1e-5],
        np.float32,
    )  # fmt: skip
    for n in (len(edges), len(edges) + 5):  # a multiple of 8, then 5 more in the tail
        x = np.resize(edges, n)
        outs = harness.run_threads([x, np.zeros(n, np.float32)], F32, DIRECT, wire=1)
        with np.errstate(over="ignore"):  # overflowing to inf is the point
            want = x.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(outs[0], want)  # NaN compares equal to NaN here


def test_stall_timeout_applies_to_compiled_code(short_timeout):
    assert jaxcomm.get_ffi_timeout() == 0.5


def _direct(v, wire=None, in_place=False):
    return jaxcomm.allreduce(
        v, "i", backend="ffi", algorithm="direct", wire_dtype=wire, in_place=in_place
    )


@pytest.mark.parametrize("n", [1, 7, 4099, 100_003])
@pytest.mark.parametrize("wire", [None, jnp.float16])
def test_in_place_direct_is_bitwise_the_out_of_place_result(n, wire):
    """The reduction writes each block after reading it from every rank, so
    the result may take the input's buffer (x * 2 is dead after the call)."""
    mesh = mesh_of((4,), ("i",))
    xs = np.random.default_rng(n).standard_normal((4, n)).astype(np.float32)
    in_place = run_sharded(lambda x: _direct(x * 2, wire, in_place=True), mesh, xs)
    fresh = run_sharded(lambda x: _direct(x * 2, wire), mesh, xs)
    np.testing.assert_array_equal(in_place, fresh)
    want = 2 * xs.astype(np.float64).sum(0)
    tol = 1e-5 if wire is None else 4 * 2.0**-11
    np.testing.assert_allclose(in_place[0], want, rtol=tol, atol=tol * 4)


def test_in_place_leaves_a_live_input_unchanged():
    """XLA copies an input that is still needed; the caller never sees it change."""
    mesh = mesh_of((4,), ("i",))
    xs = np.random.default_rng(0).standard_normal((4, 1000)).astype(np.float32)

    def f(x):
        y = x * 2
        return _direct(y, in_place=True), y, _direct(x, in_place=True), x

    reduced_y, y, reduced_x, x = run_sharded(f, mesh, xs)
    np.testing.assert_array_equal(y, 2 * xs)
    np.testing.assert_array_equal(x, xs)
    np.testing.assert_allclose(reduced_x[0], xs.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(reduced_y, 2 * reduced_x, rtol=0, atol=0)


def test_in_place_aliases_the_buffer_of_an_intermediate():
    """The compiled step reuses the operand's buffer: no copy, one alias."""
    mesh = mesh_of((4,), ("i",))
    spec = jax.sharding.PartitionSpec("i")
    x = jax.device_put(jnp.ones(4 * 256), jax.sharding.NamedSharding(mesh, spec))

    def hlo(in_place):
        f = jax.shard_map(
            lambda v: _direct(v * 2, in_place=in_place), mesh=mesh, in_specs=spec, out_specs=spec
        )
        return jax.jit(f).lower(x).compile().as_text()

    aliased, plain = hlo(True), hlo(False)
    entry = aliased[aliased.index("ENTRY") :]  # a copy fused into the multiply is no extra pass
    assert "output_to_operand_aliasing" in entry and " copy(" not in entry
    assert "output_to_operand_aliasing" not in plain


def test_production_module_carries_no_test_harness():
    assert hasattr(harness, "run_threads")
    assert not hasattr(ext, "run_threads")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pool_writes_the_parts_in_order_plus_the_addend(dtype):
    """jaxcomm_pool (chunk_sparse's gradient pool on CPU) against NumPy: one
    IEEE addition per element, so equal bitwise. Parts of odd sizes, an empty
    one among them."""
    from jaxcomm.collectives import _ffi_calls

    rng = np.random.default_rng(3)
    parts = [rng.standard_normal(n).astype(dtype) for n in (5, 0, 1, 300, 17)]
    addend = rng.standard_normal(323).astype(dtype)
    with jax.enable_x64(dtype == np.float64):
        got = jax.jit(lambda a, *p: _ffi_calls.pool(p, a))(addend, *parts)
        got = np.asarray(got)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.concatenate(parts) + addend)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pool_without_an_addend_copies_the_parts_in_order(dtype):
    """jaxcomm_pool with no addend (a bucket on CPU): the concatenation of
    the parts, bitwise; a NaN travels as it is (no addition of zeros)."""
    from jaxcomm.collectives import _ffi_calls

    rng = np.random.default_rng(4)
    parts = [rng.standard_normal(n).astype(dtype) for n in (5, 0, 1, 300, 17)]
    parts[3][7] = np.nan
    with jax.enable_x64(dtype == np.float64):
        got = jax.jit(lambda *p: _ffi_calls.pool(p, like=p[0]))(*parts)
        got = np.asarray(got)
    assert got.dtype == dtype and got.shape == (323,)
    np.testing.assert_array_equal(got, np.concatenate(parts))


@pytest.mark.parametrize(
    "sizes,dtypes,message",
    [
        ((4, 4), (np.float32, np.float32), "fewer elements than the pool"),
        ((4, 8), (np.float32, np.float32), "more elements than the pool"),
        ((6, 4), (np.float32, np.float16), "part 1 has another dtype"),
    ],
)
def test_pool_names_what_does_not_fit(sizes, dtypes, message):
    from jaxcomm.collectives import _ffi_calls

    parts = [np.ones(n, d) for n, d in zip(sizes, dtypes, strict=True)]
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(
            jax.jit(lambda a, *p: _ffi_calls.pool(p, a))(np.ones(10, np.float32), *parts)
        )


CHUNK = 7
SENT = np.array([True, False, False, True, False, True])  # 6 chunks; the last has 3 elements


def _chunk_pools(dtype):
    rng = np.random.default_rng(5)
    n = CHUNK * (SENT.size - 1) + 3
    return rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)


def _per_chunk(x):
    return [x[c * CHUNK : (c + 1) * CHUNK] for c in range(SENT.size)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunk_l1_reads_the_exchanged_pool_where_sent_the_local_one_elsewhere(dtype):
    """jaxcomm_chunk_l1 (chunk_sparse's scores on CPU) against float64 NumPy,
    a short last chunk included. A NaN where a pool is not to be read
    (exchanged on an unsent chunk, local on a sent one) changes nothing; in
    a chunk that is read, it is that chunk's norm."""
    from jaxcomm.collectives import _ffi_calls

    local, exchanged = _chunk_pools(dtype)
    want = [
        np.abs(e.astype(np.float64)).sum() if sent else np.abs(x.astype(np.float64)).sum()
        for sent, x, e in zip(SENT, _per_chunk(local), _per_chunk(exchanged), strict=True)
    ]
    exchanged[CHUNK + 1] = np.nan  # chunk 1: not sent
    local[2] = np.nan  # chunk 0: sent
    local[2 * CHUNK] = np.inf  # chunk 2: not sent, read
    want[2] = np.inf
    with jax.enable_x64(dtype == np.float64):
        call = jax.jit(lambda x, e, m: _ffi_calls.chunk_l1(x, e, m, chunk_size=CHUNK))
        got = np.asarray(call(local, exchanged, SENT))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("skip", [False, True])
def test_chunk_residual_keeps_the_unsent_chunks_decayed_or_the_old_residual(dtype, skip):
    """jaxcomm_chunk_residual against NumPy: decay x local (one multiply in the
    pool's dtype, so bitwise) on the unsent chunks, zeros on the sent ones;
    the old residual, bitwise, on a skipped step."""
    from jaxcomm.collectives import _ffi_calls

    local, old = _chunk_pools(dtype)
    decay = 0.9
    sent = np.repeat(SENT, CHUNK)[: local.size]
    want = old if skip else np.where(sent, 0, dtype(decay) * local).astype(dtype)
    with jax.enable_x64(dtype == np.float64):
        call = jax.jit(
            lambda x, m, k, o: _ffi_calls.chunk_residual(x, m, k, o, chunk_size=CHUNK, decay=decay)
        )
        got = np.asarray(call(local, SENT, np.bool_(skip), old[None]))
    assert got.shape == (1, local.size) and got.dtype == dtype
    np.testing.assert_array_equal(got[0], want)


def test_chunk_calls_name_a_mask_that_does_not_fit_the_pool():
    from jaxcomm.collectives import _ffi_calls

    local, _ = _chunk_pools(np.float32)
    short = SENT[:-1]
    wrong = "chunk mask has 5 entries but the input has 6 chunks"
    with pytest.raises(Exception, match=f"jaxcomm chunk_l1: {wrong}"):
        jax.block_until_ready(
            jax.jit(lambda x, m: _ffi_calls.chunk_l1(x, x, m, chunk_size=CHUNK))(local, short)
        )
    with pytest.raises(Exception, match=f"jaxcomm chunk_residual: {wrong}"):
        call = jax.jit(
            lambda x, m: _ffi_calls.chunk_residual(
                x, m, np.bool_(False), x, chunk_size=CHUNK, decay=0.5
            )
        )
        jax.block_until_ready(call(local, short))


# Parts that begin and end inside the 16384-element shares the direct
# schedule hands its threads, and small and empty ones.
PART_SHAPES = [(3, 5), (0,), (1,), (64, 65), (17,), (300, 301), (2, 3, 4), (40_000,)]


def _bucket(parts, algorithm, wire, *, mesh_shape=(4,)):
    """The reduced parts of one bucket, via allreduce_parts (backend="ffi"),
    and the same bucket concatenated and reduced by jaxcomm.allreduce, split."""
    from jaxcomm.collectives import reduction

    axes = ("i",) if len(mesh_shape) == 1 else ("a", "i")
    mesh = mesh_of(mesh_shape, axes)
    red = reduction(axes, op="mean", wire_dtype=wire, algorithm=algorithm, backend="ffi")

    def both(*ps):
        bucket = red.bind().allreduce_bucket(list(ps))
        flat = jaxcomm.allreduce(
            jnp.concatenate([p.ravel() for p in ps]),
            axes,
            op="mean",
            wire_dtype=wire,
            algorithm=algorithm,
            backend="ffi",
        )
        return tuple(bucket), flat

    return run_sharded(both, mesh, *parts)


@pytest.mark.parametrize("algorithm", ["direct", "ring", "hierarchical"])
@pytest.mark.parametrize("wire", [None, jnp.float16, jnp.bfloat16])
def test_allreduce_parts_is_bitwise_the_concatenated_allreduce(algorithm, wire):
    """jaxcomm_allreduce_parts (a bucket of leaves without a concatenate):
    each result is its part's slice of the allreduce of the concatenation,
    bitwise (the same additions in the same order), and the mean of a
    float64 NumPy reference within the wire's roundings."""
    mesh_shape = (2, 2) if algorithm == "hierarchical" else (4,)
    rng = np.random.default_rng(7)
    parts = [rng.standard_normal((4, *s)).astype(np.float32) for s in PART_SHAPES]
    bucket, flat = _bucket(parts, algorithm, wire, mesh_shape=mesh_shape)
    offset = 0
    for part, got in zip(parts, bucket, strict=True):
        n = part[0].size
        assert got.shape == part.shape
        np.testing.assert_array_equal(got.reshape(4, -1), flat[:, offset : offset + n])
        offset += n
        want = part.astype(np.float64).mean(0)
        # Each addend rounded to the wire, then the sum once more.
        eps = {None: 2.0**-24, jnp.float16: 2.0**-11, jnp.bfloat16: 2.0**-8}[wire]
        bound = 2 * eps * np.abs(part).max(initial=0) + 1e-6
        for row in got:
            np.testing.assert_allclose(row, want, rtol=0, atol=bound)


def test_a_bucket_of_several_leaves_is_one_call_and_no_concatenate():
    """ffi on CPU: allreduce_gradients' bucket is one jaxcomm_allreduce_parts
    call on the leaves themselves; XLA builds no bucket and slices none."""
    mesh = mesh_of((4,), ("i",))
    shapes = {"a": (64, 32), "b": (32,), "c": (32, 10)}
    tx = jaxcomm.allreduce_gradients("i", backend="ffi", bucket_bytes=float("inf"))
    state = tx.init({k: jnp.zeros(s) for k, s in shapes.items()})
    rows = {
        k: jax.ShapeDtypeStruct(
            (4, *s), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("i"))
        )
        for k, s in shapes.items()
    }

    def step(g):
        return tx.update(jax.tree.map(lambda x: x[0] * 2, g), state)[0]

    f = jax.shard_map(step, mesh=mesh, in_specs=(P("i"),), out_specs=P())
    hlo = jax.jit(f).lower(rows).compile().as_text()
    assert hlo.count('custom_call_target="jaxcomm_allreduce_parts"') == 1
    assert 'custom_call_target="jaxcomm_allreduce"' not in hlo
    # (The [group, rank] operand is an s32[2] concatenate.)
    assert not re.search(r"f32\[\d+\]\S* (concatenate|slice)\(", hlo)


def test_allreduce_parts_differentiates_like_the_concatenated_allreduce():
    """The bucket's derivative is psum's, as for one array: the gradient of
    a weighted sum of the reduced parts, in varying-typed shard_map."""
    from jaxcomm.collectives import reduction

    mesh = mesh_of((4,), ("i",))
    red = reduction("i", op="mean", backend="ffi")
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((4, *s)).astype(np.float32) for s in [(3, 4), (5,)])
    wa, wb = (rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (5,)])

    def loss_parts(x, y):
        ra, rb = red.bind().allreduce_bucket([x, y])
        return jnp.sum(ra * wa) + jnp.sum(rb * wb)

    def loss_flat(x, y):
        r = jaxcomm.allreduce(jnp.concatenate([x.ravel(), y]), "i", op="mean", backend="ffi")
        return jnp.sum(r[:12].reshape(3, 4) * wa) + jnp.sum(r[12:] * wb)

    got = run_sharded(jax.grad(loss_parts, argnums=(0, 1)), mesh, a, b)
    want = run_sharded(jax.grad(loss_flat, argnums=(0, 1)), mesh, a, b)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(got[0][0], wa / 4, rtol=1e-6)


def _raw_parts_call(parts, results):
    """jaxcomm_allreduce_parts called directly, one rank (no shard_map)."""
    from jaxcomm.collectives import _extension

    _extension.require("cpu")
    call = jax.ffi.ffi_call("jaxcomm_allreduce_parts", results)
    return call(
        np.array([0, 0], np.int32),
        *parts,
        op_id=np.int64(10**9),
        algorithm=np.int32(DIRECT),
        nranks=np.int32(1),
        intra_size=np.int32(1),
        wire_dtype=np.int32(-1),
        prescale=np.float64(1.0),
        postscale=np.float64(1.0),
    )


def test_allreduce_parts_on_one_rank_copies_each_part():
    parts = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)]
    results = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts)
    got = jax.jit(lambda *p: _raw_parts_call(p, results))(*parts)
    for g, p in zip(got, parts, strict=True):
        np.testing.assert_array_equal(g, p)


@pytest.mark.parametrize(
    "parts,results,message",
    [
        ([np.ones(4, np.float32), np.ones(4, np.float64)], None, "part 1 has another dtype"),
        ([np.ones(4, np.float32)], [(4,), (4,)], "1 inputs but 2 results"),
        ([np.ones(4, np.float32), np.ones(3, np.float32)], [(4,), (2,)], "result 1 must have"),
    ],
)
def test_allreduce_parts_names_what_does_not_fit(parts, results, message):
    shapes = [p.shape for p in parts] if results is None else results
    results = tuple(jax.ShapeDtypeStruct(s, np.float32) for s in shapes)
    with jax.enable_x64(True), pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda *p: _raw_parts_call(p, results))(*parts))
