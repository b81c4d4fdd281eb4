"""Many independent ffi collectives in one program: XLA's CPU runtime runs
them concurrently and in a different order on each device. The handlers
must not hold XLA's threads while they wait for peers (see
xla_ffi/cpu/async.h); this program deadlocked until the timeout when they did."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.harness import mesh_of


def test_many_independent_collectives_in_one_step():
    mesh = mesh_of((8,), ("data",))
    sizes = [1 << 17] * 32  # 0.5 MiB each: enough to deadlock before
    old = jaxcomm.get_ffi_timeout()
    jaxcomm.set_ffi_timeout(20.0)
    try:

        def step(*xs):
            # x * 2 first: a fusion per leaf, so XLA has work to interleave.
            return [jaxcomm.allreduce(x[0] * 2.0, "data", backend="ffi") for x in xs]

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P()))
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((8, s)).astype(np.float32) for s in sizes]
        args = [jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data"))) for x in xs]
        for _ in range(3):
            out = jax.block_until_ready(f(*args))
        for x, y in zip(xs, out, strict=True):
            np.testing.assert_allclose(
                np.asarray(y), 2 * x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5
            )
    finally:
        jaxcomm.set_ffi_timeout(old)
