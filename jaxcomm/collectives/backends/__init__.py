"""Backends: one class per implementation of the collectives, chosen here.

``backend="auto" | "xla" | "ffi"`` (or a :class:`Backend` of your own) is
resolved in two stages because JAX starts its backends on first use, which
``jax.distributed.initialize`` must precede: what needs no platform is
decided and checked when a transform is built (:func:`check`), the rest at
trace time (:func:`resolve`). This module and the classes it returns are
the only code that asks which platform jaxcomm runs on.
"""

from __future__ import annotations

import jax

from jaxcomm.collectives import _checks, _extension
from jaxcomm.collectives.backends.base import Backend
from jaxcomm.collectives.backends.cpu_ffi import CpuFfiBackend
from jaxcomm.collectives.backends.cuda_ffi import CudaFfiBackend
from jaxcomm.collectives.backends.ffi import DEFAULT_BUCKET_BYTES, FfiBackend
from jaxcomm.collectives.backends.xla import XlaBackend, XlaCpuBackend

_BY_NAME = {"xla": XlaBackend, "ffi": FfiBackend}

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Backend",
    "CpuFfiBackend",
    "CudaFfiBackend",
    "FfiBackend",
    "XlaBackend",
    "XlaCpuBackend",
    "check",
    "resolve",
]


def _prefers_ffi(masked: bool, wire, started: bool = False) -> bool:
    """'auto' leans to ffi with a chunk mask (the only backend that sends
    just the selected chunks without a static bound), with a 16-bit wire
    (XLA's CPU all-reduce adds float16 in float16, and widens bfloat16 to
    float32) and for an allreduce started in one step and finished in a
    later one (only jaxcomm's CPU transport runs outside XLA's executions);
    never for a scaled wire (FP8, int8, int4), whose schedule only xla has."""
    return not wire.scaled and (masked or wire.narrow or started)


def check(
    backend, algorithm: str, axes: tuple, wire, *, masked: bool = False, started: bool = False
):
    """The checks that need no platform, run when a transform is built.
    Returns the backend as far as it is decided: a :class:`Backend`, ``"xla"``,
    ``"ffi"`` (its handler not checked yet), or ``"auto"`` (decided at trace
    time)."""
    if not isinstance(backend, Backend):
        _checks.check_choice("backend", backend, _checks.BACKENDS)
        if backend == "auto" and not _prefers_ffi(masked, wire, started):
            backend = "xla"
    _checks.check_choice("algorithm", algorithm, _checks.ALGORITHMS)
    if algorithm == "hierarchical" and len(axes) != 2:
        raise ValueError(
            f"algorithm='hierarchical' needs axis_name=(inter_axis, intra_axis), got {axes!r}"
        )
    cls = type(backend) if isinstance(backend, Backend) else _BY_NAME.get(backend)
    if cls is not None:
        cls.check_options(algorithm, wire)
    return backend


def resolve(backend, *, masked: bool = False, wire, started: bool = False) -> Backend:
    """The backend that runs here, at trace time.

    ``"auto"`` is xla for a collective in the input's dtype: on CPU lax.psum
    is as fast as the ffi direct schedule from 16 MiB up and faster below
    (bench/allreduce.py). With a chunk mask or a 16-bit wire it is ffi where
    the CPU handlers run in one process. Across processes on CPU the ffi
    handlers run over TCP, which has not been compared with gloo widely
    enough to be the default. On GPU 'auto' is xla (with a mask, packed under
    a bound): the CUDA handlers run across processes (tools/gpu_check.sh),
    but bench/gpu_network.py has yet to time them against lax.psum there.
    An allreduce to be `started` in one step and finished in a later one is
    ffi wherever the CPU handlers run, across processes too: no other
    backend can (XLA's collectives complete inside the step).
    """
    if isinstance(backend, Backend):
        return backend
    _checks.check_choice("backend", backend, _checks.BACKENDS)
    platform = jax.default_backend()
    if backend == "auto":
        single = jax.process_count() == 1
        cpu_ffi = platform == "cpu" and _extension.available("cpu")
        if started and wire.can_start and cpu_ffi:
            return CpuFfiBackend()
        if _prefers_ffi(masked, wire) and single and cpu_ffi:
            return CpuFfiBackend()
        backend = "xla"
    if backend == "xla":
        if platform == "cpu" and _extension.available("cpu"):
            return XlaCpuBackend()
        return XlaBackend()
    _extension.require()
    if platform == "gpu":
        return CudaFfiBackend()
    return CpuFfiBackend()
