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
* Collectives run one at a time on the network, in the order they become
  ready: each starts at ``max(ready, end of the previous collective)``. A
  bucket of ``n`` elements sends ``n * density * wire itemsize`` bytes (CSC
  exchanges only the important chunks; taken in proportion, i.e. assuming they
  spread over the buckets like the bytes do).
* Chunk-sparse steps (``density < 1``) end with one more allreduce: the float32
  L1 norm of every chunk of ``chunk_elements`` elements, for the next mask.
* Without double buffering the step ends when compute and the last collective
  have both finished. With double buffering the collectives of step t only have
  to finish by the end of step t+1's backward, so in steady state the step takes
  ``max(compute, total communication)``: the slower of the two resources.
* An FP8 wire (``float8_e4m3fn``, ``float8_e5m2``) runs jaxcomm's one
  schedule for it (``algorithm`` stays ``"ring"``, the default): an
  all-to-all, float32 adds, a ring all-gather (:meth:`Cluster.alltoall_time`,
  :meth:`Cluster.allgather_time`). A bucket of ``n`` elements in ``k``
  leaves (parts) is padded to ``p`` rows of ``r = ⌈n/p⌉`` bytes; each row
  carries an int16 exponent per part in the all-to-all and one in the
  all-gather: the all-to-all moves ``p(r + 2k)`` bytes, the all-gather
  ``p(r + 2)``, the payload jaxcomm counts is ``p(r + k + 1)`` (its
  ``bytes_sent`` is ``2(p-1)/p`` of it, the ring's share) and the latency is
  ``pα`` against the ring's ``2(p-1)α``.
* An integer wire (``int8``, ``int4``) runs the same all-to-all and
  all-gather with a float32 scale per chunk of 256 elements: its bytes are
  jaxcomm's own count (``jaxcomm.collectives.Wire.exchange_bytes``):
  a byte an element for int8, half a byte for int4, 4 bytes a chunk.
* PowerSGD (``powersgd=True``, or a ``powersgd_rank``): the leaves
  :func:`jaxcomm.powersgd` compresses with the same ``rank``,
  ``min_compression_rate`` and ``mask`` (``powersgd_mask``: ``"auto"``,
  ``None`` or a bool per tensor), by its own rule
  (:func:`jaxcomm.transforms.powersgd.compressed_matrices`): a leaf of
  ``shape`` with ``ndim >= 2`` is viewed as ``(shape[0], prod(shape[1:]))``
  and compressed at its rank when ``(rows + cols) · rank ·
  min_compression_rate <= rows · cols``. The steps before ``start_step`` are
  not modelled: this is the compressed steady state. A step sends the other
  leaves in one collective (ready when its last gradient is), every P
  (``rows · rank`` elements each) in one, ready when the last compressed
  gradient is, then every Q (``cols · rank``), which
  needs the reduced P: it starts when P's collective ends. ``bucket_bytes``
  does not apply (powersgd fuses all it sends), nor do ``density`` and
  ``double_buffering`` (powersgd has neither). On the xla backend XLA's
  all-reduce combiner may merge the dense leaves' collective with P's (they
  are independent): one collective's latency fewer than modelled. The
  power step's matmuls and orthogonalisation (about
  ``6 · rows · cols · rank`` flops per matrix, the QR of P besides) are
  folded into compute like the optimizer update: the ``Workload``'s compute
  times must include them (``bench/network_model.py`` measures them with
  the rest of the step's compute).
* DiLoCo (``sync_every=H``, ``fragments=F``): no step sends gradients.
  Fragment ``f`` (:func:`jaxcomm._sync_schedule.plan_fragments` over the
  tensors in tree order) sends its pseudo-gradient after the compute of
  every step ``s`` with ``(s + 1) % H`` equal to its offset
  (:func:`jaxcomm._sync_schedule.sync_offsets`), in the buckets of
  ``bucket_bytes`` within the fragment, at the wire's width; nothing runs
  beside the sync (it is part of its step, as jaxcomm's program runs it).
  With ``delay=τ > 0`` and ``overlap`` the sync's collectives instead run
  beside compute and the landing step ``τ`` later waits for them (jaxcomm's
  program on CPU, where the sync starts the exchange and the landing
  finishes it; with ``backend="xla"`` it runs in the sync step); the result
  is then the third cycle's, steady.
  ``sparse_outer`` (SparseLoCo) sends each fragment as one all-gather of
  ``SparseOuter.payload`` bytes per device (a ring of ``p`` such rows:
  :meth:`Cluster.allgather_time`), or, where
  ``SparseOuter.exchange_for`` picks the dense exchange, as DiLoCo's
  buckets of float32 values.
  The result is per step, averaged over a cycle of ``H`` steps:
  ``iteration_time`` is the cycle's time over ``H``, ``communication_time``
  its collectives' time over ``H``, and ``collectives`` the cycle's, each
  ready when its step's compute ends. The outer step and the local
  optimizer's own work are compute, as the update is for the others.
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

  PowerSGD at rank 4 sends a (1000, 1000) matrix as 4 000 P and 4 000 Q
  elements; the (1000,) bias goes densely:

  >>> w = Workload((GradientTensor(1000, 0.0, shape=(1000,)),
  ...               GradientTensor(1_000_000, 1.0, shape=(1000, 1000))),
  ...              forward_time=0.0, batch=1)
  >>> r = simulate(w, c, Settings(powersgd_rank=4))
  >>> [(k.kind, k.nbytes) for k in r.collectives]
  [('gradients', 4000), ('P', 16000), ('Q', 16000)]

  DiLoCo syncing every 10 steps: one allreduce of the whole model (1 s on
  this link) in 10 steps of 2 s, so 2.1 s a step:

  >>> w = Workload((GradientTensor(250_000_000, 1.0),), forward_time=1.0, batch=32)
  >>> round(simulate(w, c, Settings(sync_every=10)).iteration_time, 6)
  2.1

  An FP8 wire on the 2-rank link: 1000 one-byte elements in 2 rows of 500,
  an exponent pair with each row both ways, 2 latencies:

  >>> w = Workload((GradientTensor(1000, 0.0),), forward_time=0.0, batch=1)
  >>> r = simulate(w, c, Settings(wire_dtype="float8_e4m3fn"))
  >>> r.collectives[0].nbytes, round(r.iteration_time * 1e9, 3)  # 502 + 502 bytes, ns
  (1004, 1004.0)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxcomm._sync_schedule import (
    applies,
    check_delay,
    check_sync_schedule,
    plan_fragments,
    sync_offsets,
    syncs,
)
from jaxcomm._validate import (
    check_bucket_bytes,
    check_fraction,
    check_int,
    check_nonnegative,
    check_positive_integer,
    check_positive_real,
)
from jaxcomm.collectives import DEFAULT_CHUNK_SIZE, Wire
from jaxcomm.costmodel.cluster import ALGORITHMS, Cluster
from jaxcomm.transforms import plan_buckets
from jaxcomm.transforms.powersgd import compressed_matrices
from jaxcomm.transforms.sparseloco import SparseOuter

GRADIENT_ITEMSIZE = 4  # gradients are float32 (mixed precision keeps float32 master gradients)
NORM_ITEMSIZE = 4  # CSC's chunk norms are reduced in float32
CSC_CHUNK_ELEMENTS = DEFAULT_CHUNK_SIZE  # GradientFlow's chunk size, as chunk_sparse
FP8_EXPONENT_BYTES = 2  # an FP8 wire's scale travels as an int16 exponent
FP8_WIRES = ("float8_e4m3fn", "float8_e5m2")
INTEGER_WIRES = ("int8", "int4")


@dataclasses.dataclass(frozen=True)
class GradientTensor:
    """One gradient leaf as backward produces it.

    Attributes:
      elements: number of elements.
      backward_time: seconds of backward compute from the previous tensor's
        readiness to this one's (0 for further leaves of the same layer).
      shape: the leaf's shape, whose product is ``elements``; needed only by
        PowerSGD, which compresses by shape (``None``: not known).
    """

    elements: int
    backward_time: float
    shape: tuple[int, ...] | None = None

    def __post_init__(self):
        check_int("elements", self.elements, minimum=0)
        check_nonnegative("backward_time", self.backward_time)
        if self.shape is not None:
            if not isinstance(self.shape, tuple):
                raise TypeError(f"shape={self.shape!r} must be a tuple of ints or None")
            for dim in self.shape:
                check_int("shape", dim, minimum=0)
            if math.prod(self.shape) != self.elements:
                raise ValueError(
                    f"shape={self.shape} holds {math.prod(self.shape)} elements, "
                    f"not elements={self.elements}"
                )


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
        ``"float32"``, ``"float16"``, ``jnp.bfloat16``, ``"float8_e4m3fn"``,
        ``jnp.float8_e5m2``, ``"int8"``, ``"int4"``; an 8- or 4-bit one runs the
        all-to-all schedule).
      bucket_bytes: fusion threshold θ in gradient bytes; 0 is one collective
        per tensor, ``math.inf`` one for all.
      overlap: start each bucket when its gradients exist (else after backward).
      double_buffering: communication of step t hides under step t+1's compute.
      density: fraction of chunks exchanged by CSC, in (0, 1]; 1 is dense.
      chunk_elements: CSC chunk size.
      algorithm: ``"ring"``, ``"hierarchical"`` or ``"tree"``. An FP8 wire
        has one schedule (all-to-all, all-gather): ``"ring"`` only.
      powersgd: PowerSGD with :func:`jaxcomm.powersgd`'s defaults but for the
        options below (implied by a ``powersgd_rank``).
      powersgd_rank: the rank of :func:`jaxcomm.powersgd`'s factors; ``None``:
        its default, from each matrix's shape.
      powersgd_mask: as :func:`jaxcomm.powersgd`'s ``mask``: ``"auto"``,
        ``None``, or one bool per tensor in ``Workload.tensors``' order.
      min_compression_rate: as :func:`jaxcomm.powersgd`'s.
      sync_every: ``None`` (every step communicates) or DiLoCo's ``H``, as
        :func:`jaxcomm.diloco`'s.
      fragments: Streaming DiLoCo's ``F`` (1: DiLoCo), as :func:`jaxcomm.diloco`'s.
      delay: Streaming DiLoCo's ``tau``, as :func:`jaxcomm.diloco`'s. With
        ``overlap`` the sync's collectives run beside the next ``tau`` steps'
        compute (diloco on CPU's transport); without it they run in the sync
        step (diloco with ``backend="xla"``, or on GPU).
      sparse_outer: ``None`` (DiLoCo's dense pseudo-gradient) or
        :func:`jaxcomm.sparse_outer`'s result: SparseLoCo's exchange.
    """

    wire_dtype: object = "float32"
    bucket_bytes: float = 0.0
    overlap: bool = False
    double_buffering: bool = False
    density: float = 1.0
    chunk_elements: int = CSC_CHUNK_ELEMENTS
    algorithm: str = "ring"
    powersgd: bool = False
    powersgd_rank: int | None = None
    powersgd_mask: object = "auto"
    min_compression_rate: float = 2.0
    sync_every: int | None = None
    fragments: int = 1
    delay: int = 0
    sparse_outer: SparseOuter | None = None

    def __post_init__(self):
        check_bucket_bytes(self.bucket_bytes)
        check_fraction("density", self.density, zero=False)
        check_int("chunk_elements", self.chunk_elements, minimum=1)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r} must be one of {ALGORITHMS}")
        self.wire_itemsize  # noqa: B018 -- validates wire_dtype
        check_positive_real("min_compression_rate", self.min_compression_rate)
        if self.scaled and self.algorithm != "ring":
            raise ValueError(
                f"algorithm={self.algorithm!r}: an FP8, int8 or int4 wire has one schedule "
                "(all-to-all, all-gather); leave algorithm='ring'"
            )
        if self.scaled and self.density < 1:
            raise ValueError(
                f"density={self.density}: chunk-sparse exchange over an FP8, int8 or int4 "
                "wire is not modelled"
            )
        if self.powersgd_rank is not None:
            check_positive_integer("powersgd_rank", self.powersgd_rank)
        if self.uses_powersgd and (self.density < 1 or self.double_buffering or self.scaled):
            raise ValueError(
                "powersgd: powersgd has no density or double_buffering, and takes "
                "float16 and bfloat16 wires only"
            )

        check_positive_integer("fragments", self.fragments)
        if self.sync_every is not None:
            check_sync_schedule(self.sync_every, self.fragments)
            check_delay(self.delay, self.sync_every)
            if self.density < 1 or self.double_buffering or self.uses_powersgd:
                raise ValueError(
                    f"sync_every={self.sync_every}: diloco has no density, double_buffering "
                    "or powersgd"
                )
            if self.sparse_outer is not None and not isinstance(self.sparse_outer, SparseOuter):
                raise TypeError(
                    f"sparse_outer={self.sparse_outer!r} must be jaxcomm.sparse_outer(...)'s result"
                )
            if self.sparse_outer is not None and self.scaled:
                raise ValueError(
                    f"wire_dtype={self.wire_dtype!r}: SparseLoCo's dense exchange over an FP8, "
                    "int8 or int4 wire is not modelled"
                )
        elif self.fragments != 1 or self.delay != 0 or self.sparse_outer is not None:
            raise ValueError(
                f"fragments={self.fragments}, delay={self.delay}, sparse_outer="
                f"{self.sparse_outer!r} need sync_every (DiLoCo's H)"
            )

    @property
    def uses_powersgd(self) -> bool:
        """PowerSGD is modelled: ``powersgd=True`` or a ``powersgd_rank``."""
        return bool(self.powersgd) or self.powersgd_rank is not None

    @property
    def fp8(self) -> bool:
        """An 8-bit float wire (jaxcomm scales it per device and part)."""
        return np.dtype(self.wire_dtype).name in FP8_WIRES

    @property
    def integer(self) -> bool:
        """An int8 or int4 wire (jaxcomm scales it per device and chunk)."""
        return np.dtype(self.wire_dtype).name in INTEGER_WIRES

    @property
    def scaled(self) -> bool:
        """A wire with its own all-to-all schedule: FP8, int8, int4."""
        return self.fp8 or self.integer

    @property
    def wire_itemsize(self) -> int:
        try:
            dtype = np.dtype(self.wire_dtype)
        except TypeError:
            raise ValueError(f"wire_dtype={self.wire_dtype!r} is not a dtype") from None
        if dtype.kind not in "fV" and dtype.name not in INTEGER_WIRES:  # "V": ml_dtypes'
            raise ValueError(
                f"wire_dtype={self.wire_dtype!r} must be a floating dtype, int8 or int4"
            )
        return dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Collective:
    """One allreduce on the network: which tensors (backward indices), bytes, times.

    ``kind``: ``"gradients"``, ``"norms"`` (chunk-sparse), ``"P"`` or ``"Q"``
    (PowerSGD's factors), ``"pseudo-gradient"`` (DiLoCo's sync), ``"sparse
    pseudo-gradient"`` (SparseLoCo's all-gather). ``nbytes``
    is the payload as jaxcomm counts it (an FP8 wire's exponents included).
    """

    tensors: tuple[int, ...]
    nbytes: float
    ready: float
    start: float
    end: float
    kind: str = "gradients"


@dataclasses.dataclass(frozen=True)
class Result:
    """What one simulated step costs.

    Attributes:
      iteration_time: seconds per step (steady state; DiLoCo's averaged
        over its cycle of H steps).
      throughput: examples per second over all GPUs.
      speedup: throughput over one GPU's (the same step without communication).
      scaling_efficiency: speedup / number of GPUs.
      compute_time: forward + backward.
      communication_time: total time of all collectives (busy network;
        DiLoCo's per step, averaged over its cycle).
      collectives: the schedule of one step, in network order (DiLoCo's:
        of one cycle).
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
    if settings.sync_every is not None:
        return _diloco(workload, cluster, settings)
    forward, compute = workload.forward_time, workload.compute_time
    ready_at = _ready_times(workload, settings.overlap)
    # (ready, tensors, nbytes, seconds on the network, kind)
    if settings.uses_powersgd:
        queue = _powersgd_collectives(workload, cluster, settings, ready_at)
    else:
        queue = []
        for bucket in _buckets_backward(workload, settings.bucket_bytes):
            elements = sum(workload.tensors[i].elements for i in bucket)
            nbytes, seconds = _gradient_collective(elements, len(bucket), cluster, settings)
            queue.append((ready_at[max(bucket)], bucket, nbytes, seconds, "gradients"))
    if settings.density < 1:
        norm_bytes = math.ceil(workload.elements / settings.chunk_elements) * NORM_ITEMSIZE
        seconds = cluster.allreduce_time(norm_bytes, algorithm=settings.algorithm)
        queue.append((forward + workload.backward_time, (), norm_bytes, seconds, "norms"))

    collectives, network_free = [], 0.0
    while queue:
        # The next collective ready; ties keep the queue's (the plan's) order.
        item = min(queue, key=lambda item: item[0])
        queue.remove(item)
        ready, bucket, nbytes, seconds, kind = item
        start = max(ready, network_free)
        network_free = start + seconds
        collectives.append(Collective(tuple(bucket), nbytes, ready, start, network_free, kind))
        if kind == "P":  # Q = M^T P needs the reduced P
            queue.append((network_free, *_powersgd_q(workload, cluster, settings)))

    communication = sum(c.end - c.start for c in collectives)
    if settings.double_buffering:
        iteration = max(compute, communication)
    else:
        iteration = max(compute, network_free)
    return _result(workload, cluster, iteration, communication, collectives)


def _diloco(workload: Workload, cluster: Cluster, settings: Settings) -> Result:
    """Cycles of H steps: compute each, then the fragments due (see simulate)."""
    steps, compute, delay = settings.sync_every, workload.compute_time, settings.delay
    tree = workload.tensors[::-1]  # fragments and buckets follow the tree order
    spans = plan_fragments([t.elements for t in tree], settings.fragments)
    offsets = sync_offsets(steps, settings.fragments)
    hidden = settings.overlap and delay > 0
    # Hidden collectives can end in the next cycle: the third is steady.
    cycles = 3 if hidden else 1
    collectives, clock, network_free, lands = [], 0.0, 0.0, {}
    for step in range(cycles * steps):
        if step == (cycles - 1) * steps:
            collectives, start_of_cycle = [], clock
        clock += compute
        for f, ((first, stop), offset) in enumerate(zip(spans, offsets, strict=True)):
            if hidden and applies(step, offset, steps, delay) and f in lands:
                clock = max(clock, lands.pop(f))  # the landing waits for its average
            if not syncs(step, offset, steps):
                continue
            for leaves, nbytes, seconds, kind in _sync_collectives(
                tree, first, stop, cluster, settings
            ):
                backward = tuple(len(tree) - 1 - i for i in leaves)
                begin = max(clock, network_free)
                network_free = begin + seconds
                collectives.append(Collective(backward, nbytes, clock, begin, network_free, kind))
                if not hidden:
                    clock = network_free
            lands[f] = network_free
    communication = sum(c.end - c.start for c in collectives) / steps
    return _result(workload, cluster, (clock - start_of_cycle) / steps, communication, collectives)


def _sync_collectives(tree, first: int, stop: int, cluster: Cluster, settings: Settings):
    """(tree indices, payload bytes, seconds, kind) of each collective of one
    fragment's sync: DiLoCo's buckets, or SparseLoCo's all-gather or dense
    buckets of float32 values, as :meth:`SparseOuter.exchange_for` picks."""
    sparse = settings.sparse_outer
    sizes = [t.elements for t in tree[first:stop]]
    if sparse is not None and sparse.exchange_for(sizes, cluster.p) == "all_gather":
        payload = sparse.payload(sizes)
        seconds = cluster.allgather_time(cluster.p * payload)
        return [(list(range(first, stop)), payload, seconds, "sparse pseudo-gradient")]
    out = []
    for bucket in plan_buckets([n * GRADIENT_ITEMSIZE for n in sizes], settings.bucket_bytes):
        leaves = [first + i for i in bucket]
        elements = sum(tree[i].elements for i in leaves)
        nbytes, seconds = _gradient_collective(elements, len(leaves), cluster, settings)
        out.append((leaves, nbytes, seconds, "pseudo-gradient"))
    return out


def _result(workload, cluster, iteration, communication, collectives) -> Result:
    compute = workload.compute_time
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


def _gradient_collective(
    elements: int, parts: int, cluster: Cluster, settings: Settings
) -> tuple[float, float]:
    """(payload bytes, seconds) of one bucket of ``elements`` in ``parts`` leaves."""
    if settings.fp8:
        p = cluster.p
        row = math.ceil(elements / p)  # one byte an element, padded to p rows
        to_all = p * (row + FP8_EXPONENT_BYTES * parts)
        gathered = p * (row + FP8_EXPONENT_BYTES)
        seconds = cluster.alltoall_time(to_all) + cluster.allgather_time(gathered)
        return (to_all + gathered) // 2, seconds  # p(r + k + 1)
    if settings.integer:
        to_all, gathered = Wire.of(settings.wire_dtype).exchange_bytes(elements, cluster.p, parts)
        seconds = cluster.alltoall_time(to_all) + cluster.allgather_time(gathered)
        return (to_all + gathered) // 2, seconds
    nbytes = elements * settings.density * settings.wire_itemsize
    return nbytes, cluster.allreduce_time(nbytes, algorithm=settings.algorithm)


def _compressed(workload: Workload, settings: Settings) -> list[tuple[int, int, int]]:
    """(backward index, elements of P, elements of Q) of each leaf PowerSGD compresses."""
    for i, tensor in enumerate(workload.tensors):
        if tensor.shape is None:
            raise ValueError(
                f"tensors[{i}] has no shape: powersgd needs every GradientTensor's shape"
            )
    plan = compressed_matrices(
        [t.shape for t in workload.tensors],
        rank=settings.powersgd_rank,
        min_compression_rate=settings.min_compression_rate,
        mask=settings.powersgd_mask,
    )
    return [(i, rows * rank, cols * rank) for i, rows, cols, rank in plan]


def _powersgd_collectives(workload, cluster, settings, ready_at) -> list[tuple]:
    """The dense leaves' collective and P's; Q's follows P's (see simulate)."""
    compressed = _compressed(workload, settings)
    indices = {i for i, _, _ in compressed}
    dense = tuple(i for i in range(len(workload.tensors)) if i not in indices)
    queue = []
    if dense:
        nbytes = sum(workload.tensors[i].elements for i in dense) * settings.wire_itemsize
        seconds = cluster.allreduce_time(nbytes, algorithm=settings.algorithm)
        queue.append((max(ready_at[i] for i in dense), dense, nbytes, seconds, "gradients"))
    if compressed:
        nbytes = sum(p for _, p, _ in compressed) * settings.wire_itemsize
        seconds = cluster.allreduce_time(nbytes, algorithm=settings.algorithm)
        queue.append(
            (max(ready_at[i] for i in indices), tuple(sorted(indices)), nbytes, seconds, "P")
        )
    return queue


def _powersgd_q(workload, cluster, settings) -> tuple:
    """(tensors, nbytes, seconds, kind) of the collective of every Q."""
    compressed = _compressed(workload, settings)
    nbytes = sum(q for _, _, q in compressed) * settings.wire_itemsize
    seconds = cluster.allreduce_time(nbytes, algorithm=settings.algorithm)
    return tuple(i for i, _, _ in compressed), nbytes, seconds, "Q"


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
