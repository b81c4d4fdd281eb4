"""Under shard_map(check_vma=True) a reduced result must be typed replicated,
so that out_specs=P() accepts it, as it accepts lax.psum's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

CASES = [
    ("xla", "auto"),
    ("xla", "ring"),
    ("xla", "hierarchical"),
    ("ffi", "auto"),
    ("ffi", "ring"),
    ("ffi", "hierarchical"),
]


@pytest.mark.parametrize("backend,algorithm", CASES)
def test_allreduce_result_is_typed_replicated(backend, algorithm):
    mesh = jax.make_mesh((2, 4), ("node", "local"))
    axes = ("node", "local")
    x = jax.device_put(jnp.arange(8.0 * 5).reshape(8, 5), NamedSharding(mesh, P(axes)))

    def f(v):
        return jaxcomm.allreduce(v[0], axes, algorithm=algorithm, backend=backend)

    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(axes), out_specs=P()))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x).sum(0))
