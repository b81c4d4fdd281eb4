"""Runtime controls of the ffi backend: timeout and wire-byte counters."""

from __future__ import annotations

from jaxcomm import _validate
from jaxcomm.collectives import _extension


def _ext():
    ext = _extension.cpu_module()
    if ext is None:
        raise RuntimeError("jaxcomm's compiled extension (jaxcomm._ffi) is not installed")
    return ext


def set_ffi_timeout(seconds: float) -> None:
    """Sets how long an ffi collective waits for its peers before failing.

    On CPU, a rank that does not arrive (or stops halfway) within this time
    makes the call fail with an error naming the missing ranks, instead of
    hanging (default 60 s). Where the CUDA module is built, the same value
    bounds NCCL set-up and each collective, after which the communicator is
    aborted (default 300 s there). Applies to calls made after this, in
    compiled code too. Starts no JAX backend, so it may come before
    ``jax.distributed.initialize``.
    """
    seconds = _validate.check_positive("seconds", seconds)
    _ext().set_timeout(seconds)
    cuda = _extension.cuda_module()
    if cuda is not None:
        cuda.set_timeout(seconds)


def get_ffi_timeout() -> float:
    return _ext().get_timeout()


def ffi_stats() -> dict[int, dict[str, int]]:
    """Bytes each device sent through CPU ffi collectives, and its call count.

    Returns:
      ``{device_id: {"bytes_sent": int, "calls": int}}``, counting since the
      process started or the last :func:`reset_ffi_stats`. Bytes are the
      wire-format payload the algorithm moves out of the device (2(N-1)/N of
      the buffer for an allreduce).
    """
    return {d: {"bytes_sent": b, "calls": c} for d, b, c in _ext().stats()}


def reset_ffi_stats() -> None:
    _ext().reset_stats()
