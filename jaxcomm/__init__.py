"""jaxcomm: fast gradient communication for data-parallel JAX training.

Collectives (``allreduce``, ``reduce_scatter``, ``all_gather``) with ring,
hierarchical and shared-memory schedules, narrow wire dtypes and chunk masks,
running as JAX collectives (``backend="xla"``) or as XLA FFI custom calls
(``backend="ffi"``).
"""

from jaxcomm._runtime import ffi_stats, get_ffi_timeout, reset_ffi_stats, set_ffi_timeout
from jaxcomm.collectives import all_gather, allreduce, reduce_scatter
from jaxcomm.collectives._ffi import available as ffi_available
from jaxcomm.transforms import (
    AllReduceGradientsState,
    ChunkSparseState,
    CommStats,
    PerDevice,
    allreduce_gradients,
    chunk_sparse,
    get_stats,
    plan_buckets,
    state_specs,
)

__version__ = "0.1.0"

__all__ = [
    "AllReduceGradientsState",
    "ChunkSparseState",
    "CommStats",
    "PerDevice",
    "allreduce_gradients",
    "chunk_sparse",
    "get_stats",
    "plan_buckets",
    "state_specs",
    "all_gather",
    "allreduce",
    "ffi_available",
    "ffi_stats",
    "get_ffi_timeout",
    "reduce_scatter",
    "reset_ffi_stats",
    "set_ffi_timeout",
]
