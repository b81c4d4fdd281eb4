"""allreduce differentiates like lax.psum: in vma-typed shard_map, under
shard_map(check_vma=False) and under pmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.harness import mesh_of, run_pmap


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


@pytest.mark.parametrize("algorithm", ["auto", "hierarchical"])
def test_float16_wire_mean_cotangent_near_the_range_stays_finite(algorithm):
    """The backward pass of a float16-wire mean is the same overflow-safe mean.

    On N=3 devices the xla psum paths prescale by 2^-3 and scale by 8/3 after
    the reduction. lax.psum's own transpose would cast cotangent * 8/3 to
    float16: 30000 * 8/3 = 80000 > 65504 -> inf. Without vma typing a mean
    transposes to a mean, and the mean of 30000 on every device is 30000.
    """
    n, c = 3, 30000.0
    mesh = mesh_of((n, 1), ("i", "j"))
    axes = "i" if algorithm == "auto" else ("i", "j")
    x = jax.device_put(jnp.ones((n, 4)), NamedSharding(mesh, P("i")))

    def loss(v):
        y = jaxcomm.allreduce(v, axes, op="mean", wire_dtype=jnp.float16, algorithm=algorithm)
        return jnp.sum(y * c)

    f = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
    got = np.asarray(jax.jit(f)(x))
    # Up to float16 rounding of the partial sums (11 bits, a few additions).
    assert np.isfinite(got).all(), got
    np.testing.assert_allclose(got, np.full(got.shape, c), rtol=n * 2.0**-11)
