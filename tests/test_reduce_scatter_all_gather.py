"""reduce_scatter and all_gather against NumPy, both backends."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import reference

import jaxcomm
from tests.harness import assert_same_on_all_devices as assert_replicated
from tests.harness import mesh_of, run_sharded

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("size", [1, 10, 1003])
@pytest.mark.parametrize("wire", [None, np.float16], ids=["wire-none", "wire-float16"])
def test_reduce_scatter(backend, n, size, wire):
    rng = np.random.default_rng(size + n)
    xs = rng.standard_normal((n, size)).astype(np.float32)
    out = run_sharded(
        lambda x: jaxcomm.reduce_scatter(x, "i", op="mean", backend=backend, wire_dtype=wire),
        mesh_of((n,), ("i",)),
        xs,
    )
    shard = -(-size // n)
    assert out.shape == (n, shard)
    padded = np.zeros((n, n * shard))
    padded[:, :size] = xs
    want = reference.allreduce64(padded, "mean").reshape(n, shard)
    bound = reference.error_bound(padded, "mean", wire or np.float32, np.float32)
    assert (np.abs(out - want) <= bound.reshape(n, shard)).all()


@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("wire", [None, BF16], ids=["wire-none", "wire-bfloat16"])
def test_all_gather(backend, n, wire):
    rng = np.random.default_rng(n)
    xs = rng.standard_normal((n, 3, 5)).astype(np.float32)
    out = run_sharded(
        lambda x: jaxcomm.all_gather(x, "i", backend=backend, wire_dtype=wire),
        mesh_of((n,), ("i",)),
        xs,
    )
    assert out.shape == (n, n, 3, 5)
    assert_replicated(out)
    want = xs if wire is None else xs.astype(wire).astype(np.float32)
    np.testing.assert_array_equal(out[0], want)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_reduce_scatter_then_all_gather_is_allreduce(backend):
    xs = np.random.default_rng(0).standard_normal((8, 21)).astype(np.float32)

    def fn(x):
        shard = jaxcomm.reduce_scatter(x, "i", backend=backend)
        return jaxcomm.all_gather(shard, "i", backend=backend).reshape(-1)[: x.size]

    out = run_sharded(fn, mesh_of((8,), ("i",)), xs)
    np.testing.assert_allclose(out[0], xs.astype(np.float64).sum(0), rtol=1e-6, atol=1e-6)
