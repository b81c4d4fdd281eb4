"""Bad input gives a clear error at trace time, naming the argument."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from util import mesh_of, run_sharded

import jaxcomm

# (description, kwargs for allreduce, input dtype, expected exception, message pattern)
BAD_INPUTS = [
    ("integer input", {}, np.int32, TypeError, "x has dtype int32"),
    ("complex input", {}, np.complex64, TypeError, "x has dtype complex64"),
    ("unknown op", {"op": "max"}, np.float32, ValueError, "op='max'"),
    ("unknown algorithm", {"algorithm": "tree"}, np.float32, ValueError, "algorithm='tree'"),
    ("unknown backend", {"backend": "mpi"}, np.float32, ValueError, "backend='mpi'"),
    ("integer wire dtype", {"wire_dtype": jnp.int8}, np.float32, TypeError, "wire_dtype=int8"),
    (
        "hierarchical on one axis",
        {"algorithm": "hierarchical"},
        np.float32,
        ValueError,
        "needs axis_name=\\(inter_axis, intra_axis\\)",
    ),
    (
        "direct on xla",
        {"algorithm": "direct", "backend": "xla"},
        np.float32,
        ValueError,
        "algorithm='direct'",
    ),
    ("unbound axis", {"axis_name": "nope"}, np.float32, NameError, "not bound here"),
    (
        "chunk_size <= 0",
        {"chunk_mask": jnp.ones(1, bool), "chunk_size": 0},
        np.float32,
        ValueError,
        "chunk_size=0",
    ),
    (
        "mask of wrong length",
        {"chunk_mask": jnp.ones(5, bool), "chunk_size": 4},
        np.float32,
        ValueError,
        "needs shape \\(2,\\)",
    ),
    (
        "non-boolean mask",
        {"chunk_mask": jnp.ones(2), "chunk_size": 4},
        np.float32,
        TypeError,
        "chunk_mask must be boolean",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(case):
    _, kwargs, dtype, error, pattern = case
    kwargs = dict(kwargs)
    axis = kwargs.pop("axis_name", "i")
    xs = np.ones((2, 8), dtype)
    with pytest.raises(error, match=pattern):
        run_sharded(lambda x: jaxcomm.allreduce(x, axis, **kwargs), mesh_of((2,), ("i",)), xs)


def test_bad_timeout():
    with pytest.raises(ValueError, match="must be positive"):
        jaxcomm.set_ffi_timeout(0)
