"""Optax gradient transformations that communicate: dense allreduce, chunk-sparse, DiLoCo."""

from jaxcomm.collectives import DEFAULT_BUCKET_BYTES
from jaxcomm.state import CommStats, PerDevice, get_stats, local_params, state_specs
from jaxcomm.transforms._buckets import plan_buckets
from jaxcomm.transforms.accumulate import AccumulateState, accumulate
from jaxcomm.transforms.allreduce_gradients import AllReduceGradientsState, allreduce_gradients
from jaxcomm.transforms.chunk_sparse import ChunkSparseState, chunk_sparse
from jaxcomm.transforms.diloco import DiLoCoState, diloco
from jaxcomm.transforms.double_buffered import DoubleBufferedState, double_buffered
from jaxcomm.transforms.outer_step import OptaxOuter, OuterStep
from jaxcomm.transforms.powersgd import PowerSGDState, powersgd
from jaxcomm.transforms.sparseloco import SparseOuter, sparse_outer, sparseloco

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AccumulateState",
    "AllReduceGradientsState",
    "ChunkSparseState",
    "DiLoCoState",
    "DoubleBufferedState",
    "OptaxOuter",
    "OuterStep",
    "CommStats",
    "PerDevice",
    "PowerSGDState",
    "SparseOuter",
    "accumulate",
    "allreduce_gradients",
    "chunk_sparse",
    "diloco",
    "double_buffered",
    "get_stats",
    "local_params",
    "plan_buckets",
    "powersgd",
    "sparse_outer",
    "sparseloco",
    "state_specs",
]
