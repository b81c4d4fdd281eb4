"""Optax gradient transformations that communicate: dense allreduce and chunk-sparse."""

from jaxcomm.collectives import DEFAULT_BUCKET_BYTES
from jaxcomm.transforms._buckets import plan_buckets
from jaxcomm.transforms._state import CommStats, PerDevice, get_stats, state_specs
from jaxcomm.transforms.allreduce_gradients import AllReduceGradientsState, allreduce_gradients
from jaxcomm.transforms.chunk_sparse import ChunkSparseState, chunk_sparse

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AllReduceGradientsState",
    "ChunkSparseState",
    "CommStats",
    "PerDevice",
    "allreduce_gradients",
    "chunk_sparse",
    "get_stats",
    "plan_buckets",
    "state_specs",
]
