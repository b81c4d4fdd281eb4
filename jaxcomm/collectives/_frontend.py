"""What the three collective front ends share: option resolution, scales,
and making the ffi backend differentiable like lax.psum."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.collectives import _checks, _ffi
from jaxcomm.collectives._axes import AxisPlacement, is_vma_typed, normalize, placement

DEFAULT_CHUNK_SIZE = 32768  # GradientFlow's chunk: 32K elements


def known_backend(backend: str, *, masked: bool = False) -> str:
    """The backend as far as it is decided without the platform, which JAX
    starts on first use and jax.distributed.initialize must precede: 'auto'
    is 'xla' for plain collectives and stays 'auto' with a chunk mask. An
    'ffi' here has not been checked for its handler yet."""
    _checks.check_choice("backend", backend, _checks.BACKENDS)
    return "xla" if backend == "auto" and not masked else backend


def resolve_backend(backend: str, *, masked: bool = False) -> str:
    """'auto' is 'xla' for plain collectives: on CPU lax.psum is as fast as the
    ffi direct schedule from 16 MiB up and faster below (bench/allreduce.py).
    With a chunk mask it is 'ffi' where available, the only backend that
    sends just the selected chunks without a static bound."""
    backend = known_backend(backend, masked=masked)
    if backend == "auto":
        # The CPU transport meets devices inside one process only.
        single = jax.process_count() == 1
        return "ffi" if single and _ffi.available() else "xla"
    if backend == "ffi":
        _ffi.require()
    return backend


def check_algorithm(algorithm: str, backend: str, axes: tuple) -> None:
    """The algorithm checks that need no platform (backend may still be
    'auto'), so a transform can run them when it is built without making JAX
    pick its backend (which jax.distributed.initialize must precede)."""
    _checks.check_choice("algorithm", algorithm, _checks.ALGORITHMS)
    if algorithm == "hierarchical" and len(axes) != 2:
        raise ValueError(
            f"algorithm='hierarchical' needs axis_name=(inter_axis, intra_axis), got {axes!r}"
        )
    if algorithm == "direct" and backend == "xla":
        raise ValueError(
            "algorithm='direct' is the shared-memory schedule of backend='ffi'; "
            "with backend='xla' use 'auto' (lax.psum), 'ring' or 'hierarchical'"
        )


def resolve_algorithm(algorithm: str, backend: str, axes: tuple) -> str:
    """`backend` is resolved ('xla' or 'ffi')."""
    check_algorithm(algorithm, backend, axes)
    if algorithm == "auto":
        # On one host the direct schedule beats the ring (see bench/allreduce.py);
        # XLA picks its own all-reduce algorithm.
        return "direct" if backend == "ffi" else "psum"
    return algorithm


def scales(op: str, size: int, narrow_wire: bool) -> tuple[float, float]:
    """(prescale, postscale). For a mean over a narrow wire, divide before the
    cast so large N cannot overflow float16; otherwise divide at the end. The
    paths where XLA adds in float16 trade 1/N for a power of two with
    headroom (_xla.headroom_scales)."""
    _checks.check_choice("op", op, _checks.OPS)
    if op == "sum":
        return 1.0, 1.0
    return (1.0 / size, 1.0) if narrow_wire else (1.0, 1.0 / size)


def wire_for(dtype, wire_dtype):
    wire = _checks.check_wire_dtype(wire_dtype)
    return np.dtype(dtype) if wire is None else wire


def linear_collective(forward, x, axes: tuple, scale: float, backward_allreduce):
    """forward(x), differentiated the way lax.psum is in the same context.

    forward is the linear map y = scale * sum_devices(x) (up to wire
    rounding). Its transpose is, like psum's, a pvary times scale in
    vma-typed shard_map, and the same allreduce elsewhere.
    """
    axes = normalize(axes)
    vma = is_vma_typed(x, axes)

    @jax.custom_vjp
    def f(v):
        return forward(v)

    def fwd(v):
        return forward(v), None

    def bwd(_, ct):
        if vma:
            if not is_vma_typed(ct, axes):  # a result typed as replicated
                ct = lax.pcast(ct, axes, to="varying")
            return ((ct * scale).astype(ct.dtype) if scale != 1.0 else ct,)
        return (backward_allreduce(ct),)

    f.defvjp(fwd, bwd)
    return f(x)


class Prepared(NamedTuple):
    """A collective call after validation, flattened and placed."""

    flat: jax.Array  # the input as 1-D
    dtype: np.dtype  # input (and output) dtype
    wire: np.dtype  # what travels
    backend: str  # "xla" or "ffi"
    place: AxisPlacement
    prescale: float
    postscale: float


def prepare(x, axis_name, *, op: str, wire_dtype, backend: str, masked: bool = False):
    """Validates the arguments every collective shares, in the order users
    see errors: dtype, axes, backend, wire dtype, op."""
    x = jnp.asarray(x)
    dtype = _checks.check_input_dtype("x", x.dtype)
    axes = normalize(axis_name)
    backend = resolve_backend(backend, masked=masked)
    wire = wire_for(dtype, wire_dtype)
    place = placement(axes)
    prescale, postscale = scales(op, place.size, wire != dtype)
    return Prepared(x.reshape(-1), dtype, wire, backend, place, prescale, postscale)
