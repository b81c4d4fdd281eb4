"""An allreduce started in one jitted call and finished in a later one
(BoundReduction.allreduce_start / allreduce_done, CPU's jaxcomm transport):
the result against a float64 NumPy mean, what is in flight between the
calls, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives import reduction
from tests import reference
from tests.harness import mesh_of

N = 8


def _programs(comm, mesh):
    def start(x):
        return comm.bind().allreduce_start(x[0])

    def done(handle, x):
        like = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        result, found = comm.bind().allreduce_done(handle, like)
        return result

    def lookup(handle, x):  # found or not, no error
        like = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        return comm.bind().allreduce_done(handle, like, missing_ok=True)[1]

    rows = P("data")
    return (
        jax.jit(jax.shard_map(start, mesh=mesh, in_specs=rows, out_specs=P())),
        jax.jit(jax.shard_map(done, mesh=mesh, in_specs=(P(), rows), out_specs=P())),
        jax.jit(jax.shard_map(lookup, mesh=mesh, in_specs=(P(), rows), out_specs=P())),
    )


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
@pytest.mark.parametrize("wire", [None, jnp.bfloat16])
def test_started_then_finished_is_the_mean(algorithm, wire):
    from jaxcomm import _ffi

    mesh = mesh_of((N,), ("data",))
    comm = reduction("data", op="mean", wire_dtype=wire, algorithm=algorithm, backend="ffi")
    start, done, lookup = _programs(comm, mesh)
    a = np.random.default_rng(0).normal(size=(N, 1001)).astype(np.float32)
    x = jax.device_put(a, NamedSharding(mesh, P("data")))
    before = _ffi.in_flight()
    handle = jax.block_until_ready(start(x))
    assert _ffi.in_flight() == before + N  # one per device, until its done call
    got = np.asarray(done(handle, x))
    assert _ffi.in_flight() == before
    want = a.astype(np.float64).mean(axis=0)
    if wire is None:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        bound = reference.error_bound(a, "mean", np.dtype(jnp.bfloat16), np.float32)
        assert np.all(np.abs(got - want) <= bound)
    # A handle is finished once: then it is an error, or with missing_ok not found.
    with pytest.raises(Exception, match="no allreduce in flight"):
        jax.block_until_ready(done(handle, x))
    assert int(lookup(handle, x)) == 0


def test_a_handle_of_another_job_is_refused_even_where_its_ids_match():
    """A new job's call-site ids and sequences restart: only the job's nonce
    tells a restored handle from one of this job's operations."""
    mesh = mesh_of((N,), ("data",))
    start, done, _ = _programs(reduction("data", op="mean", backend="ffi"), mesh)
    x = jax.device_put(np.ones((N, 16), np.float32), NamedSharding(mesh, P("data")))
    handle = np.asarray(start(x))
    other = handle.copy()
    other[0] ^= 1  # the same call site and sequence, another job
    with pytest.raises(Exception, match="no allreduce in flight"):
        jax.block_until_ready(done(jax.device_put(other, NamedSharding(mesh, P())), x))
    np.testing.assert_array_equal(np.asarray(done(handle, x)), np.ones(16))  # still there


def test_only_jaxcomms_cpu_transport_starts_one():
    mesh = mesh_of((N,), ("data",))
    comm = reduction("data", op="mean", backend="xla")
    assert not comm.starts_async
    assert reduction("data", op="mean", started=True).starts_async  # auto picks ffi
    start, _, _ = _programs(comm, mesh)
    x = jax.device_put(np.ones((N, 4), np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="backend='xla'"):
        start(x)
