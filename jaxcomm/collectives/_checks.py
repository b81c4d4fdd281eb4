"""The collectives' choices and dtypes, and a chunk mask against its input."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxcomm._validate import is_integer

OPS = ("sum", "mean")
ALGORITHMS = ("auto", "ring", "hierarchical", "direct")
BACKENDS = ("auto", "xla", "ffi")
INPUT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64)
WIRE_DTYPES = (
    jnp.float16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float64,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
)


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


def check_wire_dtype(wire_dtype) -> np.dtype | None:
    """Returns the wire dtype as np.dtype, or None for 'send the input dtype'."""
    if wire_dtype is None:
        return None
    try:
        dtype = np.dtype(wire_dtype)
    except TypeError as e:
        raise TypeError(
            f"wire_dtype={wire_dtype!r} is not a dtype; use None or one of {_names(WIRE_DTYPES)}"
        ) from e
    if dtype not in [np.dtype(d) for d in WIRE_DTYPES]:
        raise TypeError(
            f"wire_dtype={dtype.name} is not supported; use None or one of {_names(WIRE_DTYPES)}"
        )
    return dtype


def check_chunking(chunk_mask, chunk_size: int, size: int, max_chunks) -> int:
    """Validates a chunk mask against an input of `size` elements in chunks
    of `chunk_size` (already checked); returns the chunk count."""
    nchunks = -(-size // chunk_size)
    if chunk_mask.dtype != jnp.bool_:
        raise TypeError(f"chunk_mask must be boolean, got {chunk_mask.dtype}")
    if chunk_mask.shape != (nchunks,):
        raise ValueError(
            f"chunk_mask has shape {chunk_mask.shape}; an input of {size} elements in chunks "
            f"of {chunk_size} needs shape ({nchunks},)"
        )
    bound = max(nchunks, 1)
    if max_chunks is not None and not (is_integer(max_chunks) and 0 < max_chunks <= bound):
        raise ValueError(
            f"max_chunks={max_chunks!r} must be None or an integer in [1, {bound}] "
            "(at most the chunk count of chunk_mask)"
        )
    return nchunks
