"""jaxcomm: fast gradient communication for data-parallel JAX training.

- Transforms for the head of an optax chain: ``allreduce_gradients`` (fusion,
  wire casting, error feedback, double buffering, hierarchical) and
  ``chunk_sparse`` (GradientFlow's coarse-grained sparse exchange); and
  ``diloco`` (local steps with an outer optimizer, DiLoCo and Streaming DiLoCo).
- Collectives (``allreduce``, ``reduce_scatter``, ``all_gather``) with ring,
  hierarchical and shared-memory schedules, narrow wire dtypes and chunk
  masks, as JAX collectives (``backend="xla"``) or XLA FFI custom calls
  (``backend="ffi"``).
- ``costmodel`` and ``plan``: an alpha-beta model of a cluster and a planner.
- ``distributed``: multi-process set-up; ``python -m jaxcomm.launch`` runs
  several processes locally.
"""

from jaxcomm import _host_memory, costmodel, distributed
from jaxcomm.collectives import (
    all_gather,
    allreduce,
    ffi_available,
    ffi_stats,
    get_ffi_timeout,
    reduce_scatter,
    reset_ffi_stats,
    set_ffi_timeout,
    to_varying,
)
from jaxcomm.costmodel import plan
from jaxcomm.replicas import ReplicaDiff, check_replicas, check_replicas_host
from jaxcomm.step import data_parallel, grad, local_grad, local_value_and_grad, value_and_grad
from jaxcomm.transforms import (
    AccumulateState,
    AllReduceGradientsState,
    ChunkSparseState,
    CommStats,
    DiLoCoState,
    DoubleBufferedState,
    OptaxOuter,
    OuterStep,
    PerDevice,
    PowerSGDState,
    accumulate,
    allreduce_gradients,
    chunk_sparse,
    diloco,
    double_buffered,
    get_stats,
    local_params,
    plan_buckets,
    powersgd,
    sparse_outer,
    sparseloco,
    state_specs,
)

# Before JAX starts its threads, where JAXCOMM_KEEP_HOST_MEMORY=1 asks (see _host_memory).
_host_memory.keep_host_memory()

__version__ = "0.1.0"

__all__ = [
    "AccumulateState",
    "accumulate",
    "AllReduceGradientsState",
    "ReplicaDiff",
    "check_replicas",
    "check_replicas_host",
    "costmodel",
    "distributed",
    "plan",
    "ChunkSparseState",
    "CommStats",
    "DiLoCoState",
    "DoubleBufferedState",
    "OptaxOuter",
    "OuterStep",
    "PerDevice",
    "PowerSGDState",
    "allreduce_gradients",
    "chunk_sparse",
    "diloco",
    "double_buffered",
    "get_stats",
    "data_parallel",
    "grad",
    "local_grad",
    "local_value_and_grad",
    "local_params",
    "plan_buckets",
    "powersgd",
    "sparse_outer",
    "sparseloco",
    "state_specs",
    "all_gather",
    "allreduce",
    "ffi_available",
    "ffi_stats",
    "get_ffi_timeout",
    "reduce_scatter",
    "reset_ffi_stats",
    "set_ffi_timeout",
    "to_varying",
    "value_and_grad",
]
