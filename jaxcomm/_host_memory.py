"""Host memory that stays mapped between steps (glibc's malloc, Linux), on request.

XLA's CPU runtime allocates each execution's temporaries as one buffer, and
frees it when the execution ends. glibc serves a request above 32 MiB (its
largest mmap threshold), or above 64 MiB in a thread's own arena, with a
fresh mmap, and unmaps it on free: the next step touches every page again.
A chunk-sparse step of a 4.2M-parameter model on one CPU device has 67 MB
of temporaries: 16,460 page faults a step, 30 of its 45 ms. With
``JAXCOMM_KEEP_HOST_MEMORY=1`` in the environment, ``import jaxcomm`` asks
glibc, before JAX starts its threads, to serve every request from the main
arena's heap and to keep what is freed (``mallopt``: one arena, no mmap,
trim only above 1 GiB); the process then holds its peak heap until it exits.
It is not the default: one arena is one lock, and several CPU devices in one
process allocate from it at once (bench/README.md, "host_memory.py",
measures both sides).
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

from jaxcomm import _jax_compat

ENV = "JAXCOMM_KEEP_HOST_MEMORY"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_TRIM_ABOVE = 1 << 30

_kept = False


def keep_host_memory() -> bool:
    """Tunes glibc's malloc as the module docstring says, once, where the
    environment says ``JAXCOMM_KEEP_HOST_MEMORY=1``; returns whether it is
    tuned. Asked where it cannot be done (off Linux or glibc, or once JAX has
    started its backends, whose threads have arenas of their own by then),
    it warns and does nothing."""
    global _kept
    if _kept:
        return True
    if os.environ.get(ENV, "0") != "1":
        return False
    if _jax_compat.backends_are_initialized():
        return _cannot(
            "JAX started its backends before jaxcomm was imported: import jaxcomm "
            "before running anything in JAX"
        )
    try:
        if not sys.platform.startswith("linux"):
            raise OSError
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt ignores these
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return _cannot("it needs Linux with glibc's malloc")
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = all(
        mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_ABOVE))
    )
    return _kept


def _cannot(why: str) -> bool:
    warnings.warn(f"{ENV}=1 has no effect: {why}", stacklevel=3)
    return False
