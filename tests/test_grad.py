"""allreduce differentiates like lax.psum: in vma-typed shard_map, under
shard_map(check_vma=False) and under pmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from util import mesh_of, run_pmap

import jaxcomm


def _grad_fn(reduce):
    return jax.grad(lambda x: jnp.sum(reduce(x) ** 2))


@pytest.mark.parametrize(
    "backend,algorithm", [("ffi", "direct"), ("ffi", "ring"), ("xla", "ring"), ("xla", "auto")]
)
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_matches_psum_in_shard_map(backend, algorithm, op, check_vma):
    mesh = mesh_of((4,), ("i",))
    x = jax.device_put(jnp.arange(1.0, 9.0), NamedSharding(mesh, P("i")))
    psum = jax.lax.psum if op == "sum" else jax.lax.pmean

    def run(reduce):
        f = jax.shard_map(
            _grad_fn(reduce), mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=check_vma
        )
        return np.asarray(jax.jit(f)(x))

    ours = run(lambda v: jaxcomm.allreduce(v, "i", op=op, backend=backend, algorithm=algorithm))
    theirs = run(lambda v: psum(v, "i"))
    # Hand-worked for op="sum": y = sum of the 4 shards; d/dx sum(y^2) = 2y
    # with vma typing (pvary transpose), and 2y * 4 without (psum transpose).
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_grad_matches_psum_under_pmap(backend):
    xs = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    ours = run_pmap(_grad_fn(lambda v: jaxcomm.allreduce(v, "i", backend=backend)), 4, xs)
    y = xs.sum(0)
    np.testing.assert_allclose(ours, np.broadcast_to(2 * y * 4, xs.shape), rtol=1e-6)
