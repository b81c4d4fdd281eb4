"""jaxcomm's compiled modules: loaded once, their handlers registered with XLA.

``jaxcomm._ffi`` holds the CPU handlers, ``jaxcomm._ffi_cuda`` (built only
where nvcc and NCCL were found) the CUDA ones. Each exports
``registrations()`` (handler name -> capsule) and ``codes()``: the integer
codes its handlers read from their attributes (dtypes, algorithms, a masked
allreduce's ``unselected``), spelled once, in C++.
"""

from __future__ import annotations

import functools

import jax
import numpy as np


@functools.cache
def cpu_module():
    """The CPU module, or None when jaxcomm was installed without it."""
    try:
        from jaxcomm import _ffi
    except ImportError:
        return None
    return _ffi


@functools.cache
def cuda_module():
    """The CUDA/NCCL module if it was built, else None. Importing it starts
    no JAX backend (and no CUDA context), unlike asking JAX for GPUs."""
    try:
        from jaxcomm import _ffi_cuda
    except ImportError:
        return None
    return _ffi_cuda


@functools.cache
def cuda_runnable():
    """The CUDA/NCCL module, or None: not built, or no GPU to run it on."""
    try:
        if not jax.devices("gpu"):
            return None
    except RuntimeError:  # no GPU backend in this jax
        return None
    return cuda_module()


@functools.cache
def _register() -> frozenset:
    """Registers the handlers with XLA once; returns the platforms served."""
    platforms = set()
    ext = cpu_module()
    if ext is not None:
        for name, capsule in ext.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        platforms.add("cpu")
    cuda = cuda_runnable()
    if cuda is not None:
        for name, capsule in cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        platforms.add("gpu")
    return frozenset(platforms)


def available(platform: str | None = None) -> bool:
    """Whether the ffi backend can run on `platform` (default: jax's default backend)."""
    platform = platform or jax.default_backend()
    return platform in _register()


def require(platform: str | None = None) -> None:
    """Raises RuntimeError, saying what to do, where the ffi backend cannot run."""
    platform = platform or jax.default_backend()
    if cpu_module() is None:
        raise RuntimeError(
            "backend='ffi' needs jaxcomm's compiled extension (jaxcomm._ffi), which is not "
            "installed; reinstall jaxcomm from source, or use backend='xla'"
        )
    if not available(platform):
        raise RuntimeError(
            f"backend='ffi' has no handler for platform {platform!r} in this build "
            f"(available: {sorted(_register())}); use backend='xla'"
        )


@functools.cache
def codes() -> dict:
    """The handlers' integer codes, as the CPU module exports them:
    ``{"dtype": {name: code}, "algorithm": ..., "unselected": ..., "op": ...}``."""
    return cpu_module().codes()


def wire_code(wire, dtype) -> np.int32:
    """A call's ``wire_dtype`` attribute: -1 when the input's dtype travels."""
    if np.dtype(wire) == np.dtype(dtype):
        return np.int32(-1)
    return np.int32(codes()["dtype"][np.dtype(wire).name])


def algorithm_code(algorithm: str) -> np.int32:
    return np.int32(codes()["algorithm"][algorithm])


def unselected_code(unselected: str) -> np.int32:
    """What a masked allreduce leaves in the chunks it does not reduce."""
    return np.int32(codes()["unselected"][unselected])
