"""The collectives' choices and input dtypes, checked."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

OPS = ("sum", "mean")
ALGORITHMS = ("auto", "ring", "hierarchical", "direct", "alltoall")
BACKENDS = ("auto", "xla", "ffi")
INPUT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64)


def _names(dtypes) -> str:
    return ", ".join(np.dtype(d).name for d in dtypes)


def check_choice(argument: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{argument}={value!r} is not supported; use one of {allowed}")


def check_input_dtype(argument: str, dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in [np.dtype(d) for d in INPUT_DTYPES]:
        raise TypeError(
            f"{argument} has dtype {dtype.name}; jaxcomm collectives take {_names(INPUT_DTYPES)}"
        )
    return dtype
