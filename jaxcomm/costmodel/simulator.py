"""Step simulator: one data-parallel training step on a modelled cluster.

Inputs: the model's gradient tensors in the order backward produces them (size,
and backward time spent since the previous one was ready), the forward time, a
:class:`~jaxcomm.costmodel.Cluster` and jaxcomm's :class:`Settings`.

Rules:

* Fusion is jaxcomm's own plan, :func:`jaxcomm.transforms._buckets.plan_buckets`,
  over the gradient bytes in tree order (backward order reversed), threshold
  ``bucket_bytes`` on the gradients' own bytes (before the wire cast). A bucket
  is ready when its last gradient exists: forward time plus the backward time
  up to that gradient.
* Without overlap every bucket is ready only when backward ends.
* Collectives run one at a time on the network, in the order buckets become
  ready: a bucket starts at ``max(ready, end of the previous collective)``. A
  bucket of ``n`` elements sends ``n * density * wire itemsize`` bytes (CSC
  exchanges only the important chunks; taken in proportion, i.e. assuming they
  spread over the buckets like the bytes do).
* Chunk-sparse steps (``density < 1``) end with one more allreduce: the float32
  L1 norm of every chunk of ``chunk_elements`` elements, for the next mask.
* Without double buffering the step ends when compute and the last collective
  have both finished. With double buffering the collectives of step t only have
  to finish by the end of step t+1's backward, so in steady state the step takes
  ``max(compute, total communication)``: the slower of the two resources.
* The optimizer update and the wire casts are folded into compute; one GPU is
  the same step without communication.

Examples:
  >>> from jaxcomm.costmodel.cluster import Cluster
  >>> c = Cluster(gpus_per_node=2, nodes=1, intra_bandwidth=1e9, intra_latency=0.0,
  ...             inter_bandwidth=1e9, inter_latency=0.0)
  >>> w = Workload((GradientTensor(250_000_000, 1.0),), forward_time=1.0, batch=32)
  >>> r = simulate(w, c, Settings())  # 1e9 bytes, ring of 2 moves 1e9 at 1 GB/s: 1 s
  >>> r.iteration_time, r.throughput, r.scaling_efficiency
  (3.0, 21.333333333333332, 0.6666666666666666)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxcomm._validate import check_bucket_bytes, check_fraction, check_int, check_nonnegative
from jaxcomm.collectives import DEFAULT_CHUNK_SIZE
from jaxcomm.costmodel.cluster import ALGORITHMS, Cluster
from jaxcomm.transforms import plan_buckets

GRADIENT_ITEMSIZE = 4  # gradients are float32 (mixed precision keeps float32 master gradients)
NORM_ITEMSIZE = 4  # CSC's chunk norms are reduced in float32
CSC_CHUNK_ELEMENTS = DEFAULT_CHUNK_SIZE  # GradientFlow's chunk size, as chunk_sparse


@dataclasses.dataclass(frozen=True)
class GradientTensor:
    """One gradient leaf as backward produces it.

    Attributes:
      elements: number of elements.
      backward_time: seconds of backward compute from the previous tensor's
        readiness to this one's (0 for further leaves of the same layer).
    """

    elements: int
    backward_time: float

    def __post_init__(self):
        check_int("elements", self.elements, minimum=0)
        check_nonnegative("backward_time", self.backward_time)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One GPU's training step.

    Attributes:
      tensors: gradients in the order backward produces them.
      forward_time: seconds of forward compute.
      batch: examples per GPU per step.
    """

    tensors: tuple[GradientTensor, ...]
    forward_time: float
    batch: int

    def __post_init__(self):
        check_nonnegative("forward_time", self.forward_time)
        check_int("batch", self.batch, minimum=1)

    @property
    def backward_time(self) -> float:
        return sum(t.backward_time for t in self.tensors)

    @property
    def compute_time(self) -> float:
        """Forward plus backward: the one-GPU step time."""
        return self.forward_time + self.backward_time

    @property
    def elements(self) -> int:
        return sum(t.elements for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class Settings:
    """jaxcomm's communication settings.

    Attributes:
      wire_dtype: dtype on the wire (anything ``numpy.dtype`` accepts, e.g.
        ``"float32"``, ``"float16"``, ``jnp.bfloat16``).
      bucket_bytes: fusion threshold θ in gradient bytes; 0 is one collective
        per tensor, ``math.inf`` one for all.
      overlap: start each bucket when its gradients exist (else after backward).
      double_buffering: communication of step t hides under step t+1's compute.
      density: fraction of chunks exchanged by CSC, in (0, 1]; 1 is dense.
      chunk_elements: CSC chunk size.
      algorithm: ``"ring"``, ``"hierarchical"`` or ``"tree"``.
    """

    wire_dtype: object = "float32"
    bucket_bytes: float = 0.0
    overlap: bool = False
    double_buffering: bool = False
    density: float = 1.0
    chunk_elements: int = CSC_CHUNK_ELEMENTS
    algorithm: str = "ring"

    def __post_init__(self):
        check_bucket_bytes(self.bucket_bytes)
        check_fraction("density", self.density, zero=False)
        check_int("chunk_elements", self.chunk_elements, minimum=1)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r} must be one of {ALGORITHMS}")
        self.wire_itemsize  # noqa: B018 -- validates wire_dtype

    @property
    def wire_itemsize(self) -> int:
        try:
            dtype = np.dtype(self.wire_dtype)
        except TypeError:
            raise ValueError(f"wire_dtype={self.wire_dtype!r} is not a dtype") from None
        if dtype.kind not in "fV":  # "V": ml_dtypes' bfloat16
            raise ValueError(f"wire_dtype={self.wire_dtype!r} must be a floating dtype")
        return dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Collective:
    """One allreduce on the network: which tensors (backward indices), bytes, times."""

    tensors: tuple[int, ...]
    nbytes: float
    ready: float
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Result:
    """What one simulated step costs.

    Attributes:
      iteration_time: seconds per step (steady state).
      throughput: examples per second over all GPUs.
      speedup: throughput over one GPU's (the same step without communication).
      scaling_efficiency: speedup / number of GPUs.
      compute_time: forward + backward.
      communication_time: total time of all collectives (busy network).
      collectives: the schedule of one step, in network order.
    """

    iteration_time: float
    throughput: float
    speedup: float
    scaling_efficiency: float
    compute_time: float
    communication_time: float
    collectives: tuple[Collective, ...]


def simulate(workload: Workload, cluster: Cluster, settings: Settings) -> Result:
    """Simulates one steady-state training step; see the module docstring for the rules."""
    forward, compute = workload.forward_time, workload.compute_time
    ready_at = _ready_times(workload, settings.overlap)
    queue = [
        (ready_at[max(bucket)], bucket, sum(workload.tensors[i].elements for i in bucket))
        for bucket in _buckets_backward(workload, settings.bucket_bytes)
    ]
    if settings.density < 1:
        chunks = math.ceil(workload.elements / settings.chunk_elements)
        queue.append((forward + workload.backward_time, (), None))
        norm_bytes = chunks * NORM_ITEMSIZE
    queue.sort(key=lambda item: item[0])  # stable: ties keep the plan's order

    collectives, network_free = [], 0.0
    for ready, bucket, elements in queue:
        if elements is None:
            nbytes = norm_bytes
        else:
            nbytes = elements * settings.density * settings.wire_itemsize
        duration = cluster.allreduce_time(nbytes, algorithm=settings.algorithm)
        start = max(ready, network_free)
        network_free = start + duration
        collectives.append(Collective(tuple(bucket), nbytes, ready, start, network_free))

    communication = sum(c.end - c.start for c in collectives)
    if settings.double_buffering:
        iteration = max(compute, communication)
    else:
        iteration = max(compute, network_free)
    if iteration == 0:  # no compute and nothing to send
        throughput, speedup = math.inf, float(cluster.p)
    else:
        throughput = cluster.p * workload.batch / iteration
        speedup = cluster.p * compute / iteration  # throughput / (batch / compute)
    return Result(
        iteration_time=iteration,
        throughput=throughput,
        speedup=speedup,
        scaling_efficiency=speedup / cluster.p,
        compute_time=compute,
        communication_time=communication,
        collectives=tuple(collectives),
    )


def _ready_times(workload: Workload, overlap: bool) -> list[float]:
    """When each tensor (backward index) exists; all at backward's end without overlap."""
    end = workload.compute_time
    if not overlap:
        return [end] * len(workload.tensors)
    times, t = [], workload.forward_time
    for tensor in workload.tensors:
        t += tensor.backward_time
        times.append(t)
    return times


def _buckets_backward(workload: Workload, bucket_bytes: float) -> tuple[tuple[int, ...], ...]:
    """jaxcomm's fusion plan, with leaf indices in backward order."""
    n = len(workload.tensors)
    tree_order_bytes = [t.elements * GRADIENT_ITEMSIZE for t in reversed(workload.tensors)]
    plan = plan_buckets(tree_order_bytes, bucket_bytes)
    return tuple(tuple(n - 1 - leaf for leaf in bucket) for bucket in plan)
