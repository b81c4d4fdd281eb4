"""One front end per collective; one class per backend in backends/.

:func:`reduction` is the seam for code built on the collectives (the
transforms): an allreduce described and checked once, bound at trace time.
:class:`Backend` is what a backend implements, :class:`ChunkLayout` how a pool
is cut into chunks, :class:`Wire` what travels.
"""

from jaxcomm.collectives._extension import available as ffi_available
from jaxcomm.collectives._runtime import (
    ffi_stats,
    get_ffi_timeout,
    reset_ffi_stats,
    set_ffi_timeout,
)
from jaxcomm.collectives.all_gather import all_gather
from jaxcomm.collectives.allreduce import allreduce
from jaxcomm.collectives.backends import Backend, XlaBackend
from jaxcomm.collectives.chunk_layout import ChunkLayout
from jaxcomm.collectives.reduce_scatter import reduce_scatter
from jaxcomm.collectives.reduction import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_SIZE,
    BoundReduction,
    Reduction,
    reduction,
)
from jaxcomm.collectives.varying import to_varying, varying_axes
from jaxcomm.collectives.wire import Wire

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHUNK_SIZE",
    "Backend",
    "BoundReduction",
    "ChunkLayout",
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
    "varying_axes",
    "Wire",
    "XlaBackend",
]
