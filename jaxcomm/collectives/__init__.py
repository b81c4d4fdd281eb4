"""One front end per collective; backends in _xla.py (JAX) and _ffi.py (xla_ffi/).

:func:`reduction` is the seam for code built on the collectives (the
transforms): an allreduce described and checked once, bound at trace time.
"""

from jaxcomm.collectives._ffi import available as ffi_available
from jaxcomm.collectives._runtime import (
    ffi_stats,
    get_ffi_timeout,
    reset_ffi_stats,
    set_ffi_timeout,
)
from jaxcomm.collectives.all_gather import all_gather
from jaxcomm.collectives.allreduce import allreduce
from jaxcomm.collectives.reduce_scatter import reduce_scatter
from jaxcomm.collectives.reduction import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_SIZE,
    BoundReduction,
    Reduction,
    reduction,
)
from jaxcomm.collectives.varying import to_varying

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHUNK_SIZE",
    "BoundReduction",
    "Reduction",
    "all_gather",
    "allreduce",
    "ffi_available",
    "ffi_stats",
    "get_ffi_timeout",
    "reduce_scatter",
    "reduction",
    "reset_ffi_stats",
    "set_ffi_timeout",
    "to_varying",
]
