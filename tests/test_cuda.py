"""The CUDA backend (xla_ffi/cuda): kernels against NumPy, NCCL collectives on
one rank for every wire dtype, and training steps (plain JAX and Flax NNX with
optax) with backend="ffi" matching backend="xla".

Needs a CUDA GPU, jax's CUDA plugin, and jaxcomm built with the CUDA module
(``jaxcomm._ffi_cuda``; see README). One GPU is enough: a one-rank NCCL
communicator still runs the whole handler (communicator set-up, hierarchical
split, the ncclAllReduce path, mask pack/unpack). Tests over several GPUs run
where the machine has them.
"""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.collectives import _extension, _ffi_calls
from jaxcomm.collectives._axes import placement
from jaxcomm.collectives.backends import CudaFfiBackend

pytestmark = pytest.mark.gpu

FLOATS = [jnp.float32, jnp.float16, jnp.bfloat16]


@pytest.fixture(autouse=True)
def _enough_devices():
    """Overrides conftest's 8-device rule: these tests need one GPU, and the
    CUDA module built (a GPU machine without it is a broken install)."""
    assert _extension.available("gpu"), (
        "a GPU is present but jaxcomm._ffi_cuda did not load: rebuild with nvcc and "
        "nvidia-nccl-cu13 installed (JAXCOMM_CUDA=1 pip install --no-build-isolation -e .)"
    )


@functools.cache
def _register_kernels():
    """The kernel handlers on their own (cast, pack/unpack, chunk norms):
    jaxcomm registers only the collectives, so the tests register these."""
    for name, capsule in _extension.cuda_module().testing_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def _call(name, out, *args, **attrs):
    _register_kernels()
    return jax.jit(lambda *a: jax.ffi.ffi_call(name, out)(*a, **attrs))(*args)


def _random(n, dtype, seed=0):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 3
    return x.astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8)


# --- kernels against NumPy -----------------------------------------------


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0])
def test_cast_matches_numpy_bitwise(src, dst, scale):
    x = _random(100_003, src)
    y = _call(
        "jaxcomm_cast", jax.ShapeDtypeStruct(x.shape, dst), jnp.asarray(x), scale=np.float64(scale)
    )
    # float32 arithmetic, one round-to-nearest-even into dst: what the CPU loops do.
    expected = (x.astype(np.float32) * np.float32(scale)).astype(dst)
    np.testing.assert_array_equal(_bits(y), _bits(expected))


def test_cast_rounds_ties_to_even_and_overflows_to_inf():
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65520.0, -65520.0, 65519.0], np.float32)
    y = _call("jaxcomm_cast", jax.ShapeDtypeStruct(x.shape, jnp.float16), x, scale=np.float64(1))
    np.testing.assert_array_equal(np.asarray(y), x.astype(np.float16))
    assert np.isinf(np.asarray(y)[2:4]).all()


def _mask(nchunks, seed):
    mask = np.random.default_rng(seed).random(nchunks) < 0.5
    mask[0] = True
    return mask


def _packed_reference(x, mask, chunk_size):
    chunks = [x[c * chunk_size : (c + 1) * chunk_size] for c in range(len(mask))]
    packed = np.concatenate([c for c, m in zip(chunks, mask, strict=True) if m])
    return np.concatenate([packed, np.zeros(x.size - packed.size, x.dtype)])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n,chunk_size", [(1000, 64), (100_000, 3000), (70_000, 32768)])
@pytest.mark.parametrize("last_selected", [False, True])
def test_pack_and_unpack_chunks_match_numpy(dtype, n, chunk_size, last_selected):
    x = _random(n, dtype, seed=1)
    nchunks = -(-n // chunk_size)
    mask = _mask(nchunks, seed=n)
    mask[-1] = last_selected
    like = jax.ShapeDtypeStruct(x.shape, dtype)
    packed = _call("jaxcomm_pack_chunks", like, x, mask, chunk_size=np.int64(chunk_size))
    np.testing.assert_array_equal(_bits(packed), _bits(_packed_reference(x, mask, chunk_size)))

    base = _random(n, dtype, seed=2)
    y = _call("jaxcomm_unpack_chunks", like, packed, base, mask, chunk_size=np.int64(chunk_size))
    expected = base.copy()
    for c in np.flatnonzero(mask):
        expected[c * chunk_size : (c + 1) * chunk_size] = x[c * chunk_size : (c + 1) * chunk_size]
    np.testing.assert_array_equal(_bits(y), _bits(expected))


@pytest.mark.parametrize("dtype", FLOATS)
# 3001: chunks start off the kernel's 16-byte vector boundaries, so each has
# a head and a tail read element by element around its vectors.
@pytest.mark.parametrize("n,chunk_size", [(1000, 64), (1_000_001, 32768), (5, 1), (100_003, 3001)])
def test_chunk_norms_match_numpy(dtype, n, chunk_size):
    x = _random(n, dtype, seed=3)
    nchunks = -(-n // chunk_size)
    norms = _call(
        "jaxcomm_chunk_norms",
        jax.ShapeDtypeStruct((nchunks,), jnp.float32),
        x,
        chunk_size=np.int64(chunk_size),
    )
    padded = np.zeros(nchunks * chunk_size, np.float64)
    padded[:n] = np.abs(x.astype(np.float64))
    expected = padded.reshape(nchunks, chunk_size).sum(1)
    np.testing.assert_allclose(np.asarray(norms), expected, rtol=1e-5)


def test_kernel_errors_come_back_as_exceptions():
    x = jnp.ones(10, jnp.float32)
    with pytest.raises(Exception, match="chunk_size <= 0"):
        # GPU dispatch is asynchronous: the handler's error is raised when the
        # result is waited for, not when the call is issued.
        y = _call(
            "jaxcomm_chunk_norms",
            jax.ShapeDtypeStruct((1,), jnp.float32),
            x,
            chunk_size=np.int64(0),
        )
        jax.block_until_ready(y)


# --- NCCL collectives on one rank ------------------------------------------


def _one_gpu(fn, *arrays):
    """Runs fn inside shard_map over a one-GPU mesh axis 'x'."""
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    spec = P("x")
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]
    return jax.tree.map(np.asarray, f(*args))


_CUDA = CudaFfiBackend()


def _allreduce(v, place, **options):
    """The allreduce handler itself, with the peers and coords the CUDA
    backend gives it (the public API skips the call on one rank)."""
    return _ffi_calls.allreduce(v, _CUDA.coords(place), _CUDA.peers(v, place), place, **options)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "direct", "alltoall"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("wire", FLOATS)
def test_one_rank_allreduce_each_wire_dtype(algorithm, dtype, wire):
    x = _random(4099, dtype, seed=4)

    def fn(v):
        return _allreduce(
            v,
            placement("x"),
            algorithm=algorithm,
            wire=np.dtype(wire),
            prescale=0.25,
            postscale=1.0,
        )

    for _ in range(2):  # the second call reuses the cached communicator
        y = _one_gpu(fn, x)
        # One rank: nothing travels, so nothing is rounded to the wire dtype.
        expected = (x.astype(np.float32) * np.float32(0.25)).astype(dtype)
        np.testing.assert_array_equal(_bits(y), _bits(expected))


@pytest.mark.parametrize("max_chunks", [None, 3])
@pytest.mark.parametrize("algorithm", ["ring", "direct", "alltoall"])
@pytest.mark.parametrize("wire", FLOATS)
def test_one_rank_masked_allreduce(algorithm, wire, max_chunks):
    n, chunk_size = 10_000, 512
    x = _random(n, np.float32, seed=5)
    mask = _mask(-(-n // chunk_size), seed=6)

    def fn(v, m):
        return _allreduce(
            v,
            placement("x"),
            algorithm=algorithm,
            wire=np.dtype(wire),
            prescale=1.0,
            postscale=0.5,
            chunk_mask=m,
            chunk_size=chunk_size,
            max_chunks=max_chunks,
        )

    y = _one_gpu(fn, x, mask)
    # The handler reduces the first max_chunks selected chunks only.
    reduced = mask & (np.cumsum(mask) <= (max_chunks or mask.size))
    scaled = np.repeat(reduced, chunk_size)[:n]
    np.testing.assert_array_equal(y, np.where(scaled, x * np.float32(0.5), x))


@pytest.mark.parametrize("wire", FLOATS)
def test_one_rank_reduce_scatter_and_all_gather(wire):
    x = _random(777, np.float32, seed=7)

    def fn(v):
        place = placement("x")
        coords, w = _CUDA.coords(place), np.dtype(wire)
        rs = _ffi_calls.reduce_scatter(
            v, coords, _CUDA.peers(v, place), place, wire=w, prescale=2.0, postscale=1.0
        )
        ag = _ffi_calls.all_gather(v, coords, _CUDA.peers(v, place), place, wire=w)
        return rs, ag.reshape(-1)

    rs, ag = _one_gpu(fn, x)
    np.testing.assert_array_equal(rs, x * 2)
    # all_gather sends its own block through the wire dtype too (bitwise-equal ranks).
    np.testing.assert_array_equal(ag, x.astype(wire).astype(np.float32))


def _peers(op_id):
    """What a raw call names its peers by: its one-device group where the
    handlers run on XLA's communicators, else a call-site id."""
    if _extension.cuda_module().uses_xla_communicators:
        return {"groups": np.zeros(1, np.int64)}
    return {"op_id": np.int64(op_id)}


def test_handlers_use_xla_communicators_where_jaxlib_lends_them():
    """Built against a jaxlib whose FFI has the collectives extension, the
    collectives run on XLA's NCCL communicators, requested in Prepare."""
    header = pathlib.Path(jax.ffi.include_dir()) / "xla/ffi/api/collectives_api.h"
    # tools/gpu_check.sh also runs these tests on a build forced onto
    # jaxcomm's own communicators, and says so.
    forced_own = os.environ.get("JAXCOMM_TEST_OWN_COMMS") == "1"
    cuda = _extension.cuda_module()
    assert cuda.uses_xla_communicators == (header.exists() and not forced_own)
    assert not set(cuda.testing_registrations()) & set(cuda.registrations())
    stages = cuda.registrations()["jaxcomm_allreduce"]
    if cuda.uses_xla_communicators:
        assert sorted(stages) == ["execute", "prepare"]
    else:
        assert not isinstance(stages, dict)


def test_bad_algorithm_code_is_an_error_not_a_crash():
    x = jnp.ones(8, jnp.float32)

    def fn(v):
        call = jax.ffi.ffi_call("jaxcomm_allreduce", jax.ShapeDtypeStruct(v.shape, v.dtype))
        coords = jnp.zeros(2, jnp.int32)
        return call(
            v,
            coords,
            jnp.zeros((0,), jnp.bool_),
            **_peers(10**12),
            algorithm=np.int32(7),
            nranks=np.int32(1),
            intra_size=np.int32(1),
            wire_dtype=np.int32(-1),
            prescale=np.float64(1),
            postscale=np.float64(1),
            chunk_size=np.int64(1),
            max_chunks=np.int64(0),
            unselected=np.int32(0),
        )

    with pytest.raises(Exception, match="unknown algorithm code 7"):
        jax.block_until_ready(jax.jit(fn)(x))


def test_allreduce_output_unlike_input_is_an_error():
    x = jnp.ones(8, jnp.float32)

    def fn(v):
        call = jax.ffi.ffi_call("jaxcomm_allreduce", jax.ShapeDtypeStruct((4,), jnp.float16))
        return call(
            v,
            jnp.zeros(2, jnp.int32),
            jnp.zeros((0,), jnp.bool_),
            **_peers(10**12 + 1),
            algorithm=np.int32(2),
            nranks=np.int32(1),
            intra_size=np.int32(1),
            wire_dtype=np.int32(-1),
            prescale=np.float64(1),
            postscale=np.float64(1),
            chunk_size=np.int64(1),
            max_chunks=np.int64(0),
            unselected=np.int32(0),
        )

    with pytest.raises(Exception, match="output must have x's dtype and size"):
        jax.block_until_ready(jax.jit(fn)(x))


# --- several GPUs, where the machine has them -------------------------------


def _gpu_mesh(n):
    gpus = jax.devices("gpu")
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs, found {len(gpus)}")
    return jax.make_mesh((n,), ("data",), devices=gpus[:n])


@pytest.mark.parametrize("algorithm", ["ring", "direct", "hierarchical", "alltoall"])
@pytest.mark.parametrize("wire", [None, jnp.bfloat16, jnp.float16])
def test_multi_gpu_allreduce_matches_numpy(algorithm, wire):
    n = max(2, len(jax.devices("gpu")))
    mesh = _gpu_mesh(n)
    xs = np.stack([_random(10_001, np.float32, seed=s) for s in range(n)])
    if algorithm == "hierarchical":
        if n % 2:
            pytest.skip("hierarchical needs an even number of GPUs")
        mesh = jax.make_mesh((n // 2, 2), ("node", "local"), devices=jax.devices("gpu")[:n])
        axes = ("node", "local")
    else:
        axes = "data"
    spec = P(tuple(mesh.axis_names))

    def fn(v):
        return jaxcomm.allreduce(v[0], axes, algorithm=algorithm, wire_dtype=wire, backend="ffi")[
            None
        ]

    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
    out = np.asarray(f(jax.device_put(xs, NamedSharding(mesh, spec))))
    tol = 1e-5 if wire is None else 2e-2
    for row in out:
        np.testing.assert_allclose(row, xs.astype(np.float64).sum(0), rtol=tol, atol=tol * n * 3)
        assert row.tobytes() == out[0].tobytes()


# --- a training step: backend="ffi" matches backend="xla" ------------------


def _mlp_init(key, sizes=(32, 64, 10)):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        key, sub = jax.random.split(key)
        params.append(
            {
                "w": jax.random.normal(sub, (fan_in, fan_out)) / np.sqrt(fan_in),
                "b": jnp.zeros(fan_out),
            }
        )
    return params


def _loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 10), -1))


def _train(reduce_grad, steps=3):
    """Plain SGD on an MLP over all GPUs, gradients reduced leaf by leaf with
    `reduce_grad`; returns the parameters and the step's lowered text."""
    gpus = jax.devices("gpu")
    mesh = jax.make_mesh((len(gpus),), ("data",), devices=gpus)
    batch = 8 * len(gpus)
    x = jax.random.normal(jax.random.key(1), (steps, batch, 32))
    y = jax.random.randint(jax.random.key(2), (steps, batch), 0, 10)

    def step(params, xb, yb):
        grads = jax.tree.map(reduce_grad, jax.grad(_loss)(params, xb, yb))
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    f = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=False
        )
    )
    # shard_map no longer moves arguments to match in_specs: they must arrive placed.
    params = jax.device_put(_mlp_init(jax.random.key(0)), NamedSharding(mesh, P()))
    rows = NamedSharding(mesh, P("data"))
    lowered = f.lower(params, jax.device_put(x[0], rows), jax.device_put(y[0], rows)).as_text()
    for s in range(steps):
        params = f(params, jax.device_put(x[s], rows), jax.device_put(y[s], rows))
        jax.block_until_ready(params)
    return jax.tree.map(np.asarray, params), lowered


def _public_allreduce(backend, algorithm, wire):
    return lambda g: jaxcomm.allreduce(
        g, "data", op="mean", algorithm=algorithm, wire_dtype=wire, backend=backend
    )


def _assert_close(a_tree, b_tree, tol):
    for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("algorithm,wire", [("auto", None), ("ring", None), ("ring", "bf16")])
def test_training_step_ffi_matches_xla(algorithm, wire):
    wire = jnp.bfloat16 if wire == "bf16" else None
    ffi, ffi_text = _train(_public_allreduce("ffi", algorithm, wire))
    xla_algorithm = "ring" if algorithm == "ring" else "auto"
    xla, xla_text = _train(_public_allreduce("xla", xla_algorithm, wire))
    assert "jaxcomm_allreduce" not in xla_text
    # A one-rank axis has nothing to reduce, so every backend skips the call;
    # over several GPUs the ffi step must run the handler.
    assert ("jaxcomm_allreduce" in ffi_text) == (len(jax.devices("gpu")) > 1)
    _assert_close(ffi, xla, 1e-5 if wire is None else 2e-2)


@pytest.mark.parametrize("algorithm", ["ring", "direct", "hierarchical"])
@pytest.mark.parametrize("wire", [None, jnp.bfloat16])
def test_training_step_through_the_handler_matches_xla(algorithm, wire):
    """The handler itself on the step's real gradients, called directly so
    that it runs even on one GPU, where the public API skips it."""

    def handler_mean(g):
        place = placement("data")
        flat = _allreduce(
            g.reshape(-1),
            place,
            algorithm=algorithm,
            wire=np.dtype(wire or g.dtype),
            prescale=1.0,
            postscale=1.0 / place.size,
        )
        return flat.reshape(g.shape)

    ffi, ffi_text = _train(handler_mean)
    xla, _ = _train(_public_allreduce("xla", "auto", wire))
    assert "jaxcomm_allreduce" in ffi_text
    _assert_close(ffi, xla, 1e-5 if wire is None else 2e-2)


def _flax_run(head):
    """Three steps of a Flax NNX model under nnx.Optimizer (optax SGD with
    momentum behind `head`) over all GPUs; parameters and lowered text."""
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(12, 16, rngs=rngs)
            self.b = nnx.Linear(16, 5, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    gpus = jax.devices("gpu")
    mesh = jax.make_mesh((len(gpus),), ("data",), devices=gpus)
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(head, optax.sgd(0.1, 0.9)), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        mdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            logits = nnx.merge(mdef, p, rest)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        optimizer.update(model, jax.grad(loss)(params))
        return nnx.state((model, optimizer))

    # check_vma=False: on a one-device mesh jaxcomm.allreduce returns its
    # input still typed as varying over the axis, which out_specs=P() rejects.
    run = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=False
        )
    )
    state = jax.device_put(state, NamedSharding(mesh, P()))
    rng = np.random.default_rng(0)
    rows = NamedSharding(mesh, P("data"))
    xs = rng.standard_normal((3, 8 * len(gpus), 12)).astype(np.float32)
    ys = rng.integers(0, 5, (3, 8 * len(gpus))).astype(np.int32)
    lowered = run.lower(state, jax.device_put(xs[0], rows), jax.device_put(ys[0], rows)).as_text()
    for x, y in zip(xs, ys, strict=True):
        state = jax.block_until_ready(run(state, jax.device_put(x, rows), jax.device_put(y, rows)))
    model, _ = nnx.merge(graphdef, state)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))), lowered


def test_flax_step_ffi_matches_xla():
    ffi, ffi_text = _flax_run(jaxcomm.allreduce_gradients("data", backend="ffi"))
    xla, xla_text = _flax_run(jaxcomm.allreduce_gradients("data", backend="xla"))
    assert "jaxcomm_" not in xla_text
    # As above: one GPU has a one-rank axis, which no backend sends anywhere.
    assert ("jaxcomm_allreduce" in ffi_text) == (len(jax.devices("gpu")) > 1)
    _assert_close(ffi, xla, 1e-5)
