"""The planner: which bucket size, algorithm and wire dtype to use on a cluster.

:func:`plan` simulates every combination of the candidate settings with
:func:`~jaxcomm.costmodel.simulate` and returns the fastest, together with the
predicted gain of each choice: the step time with that one setting put back to
the baseline's (one allreduce per tensor, ring, float32 on the wire) and the
others as recommended, over the recommended step time. The total gain is the
baseline's step time over the recommended one.

Examples:
  >>> import jax, math
  >>> from jaxcomm.costmodel import pcie_infiniband
  >>> grads = [jax.ShapeDtypeStruct((1000,), "float32")] * 50
  >>> p = plan(grads, pcie_infiniband(nodes=4))
  >>> p.algorithm, p.wire_dtype, len(p.result.collectives)  # tiny tensors: few hops, one bucket
  ('hierarchical', 'bfloat16', 1)
  >>> print(p)  # doctest: +ELLIPSIS
  jaxcomm plan: 32 GPUs (4 nodes x 8), 50 gradient tensors, 0.2 MB
    bucket_bytes = 256 KiB ...
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax

from jaxcomm.costmodel.cluster import Cluster
from jaxcomm.costmodel.simulator import (
    GRADIENT_ITEMSIZE,
    GradientTensor,
    Result,
    Settings,
    Workload,
    simulate,
)

DEFAULT_BUCKET_BYTES = (0.0, *(float(1 << k) for k in range(16, 29)), math.inf)  # 0, 64K..256M, inf
DEFAULT_WIRE_DTYPES = ("float32", "bfloat16", "float16")  # on a tie the earlier wins
DEFAULT_ALGORITHMS = ("ring", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's recommendation.

    Attributes:
      bucket_bytes: fusion threshold θ for ``allreduce_gradients``.
      algorithm: allreduce algorithm.
      wire_dtype: dtype on the wire.
      settings: the full :class:`Settings` simulated.
      result: the simulated step with these settings.
      baseline: the simulated step with ring, float32, one allreduce per tensor.
      gains: per setting name, the step time with only that setting put back
        to the baseline's, over the recommended step time (1.0: no gain).
      cluster: the cluster planned for.
      tensors: number of gradient tensors.
      nbytes: gradient bytes (float32).
    """

    bucket_bytes: float
    algorithm: str
    wire_dtype: str
    settings: Settings
    result: Result
    baseline: Result
    gains: dict
    cluster: Cluster
    tensors: int
    nbytes: int

    @property
    def speedup(self) -> float:
        """Baseline step time over the recommended step time."""
        return self.baseline.iteration_time / self.result.iteration_time

    def __str__(self) -> str:
        c = self.cluster
        theta = "inf (one bucket)" if math.isinf(self.bucket_bytes) else _size(self.bucket_bytes)
        return "\n".join(
            [
                f"jaxcomm plan: {c.p} GPUs ({c.nodes} nodes x {c.gpus_per_node}), "
                f"{self.tensors} gradient tensors, {self.nbytes / 1e6:.1f} MB",
                f"  bucket_bytes = {theta:<18} x{self.gains['bucket_bytes']:.2f} "
                "vs one allreduce per tensor (others as recommended)",
                f"  algorithm    = {self.algorithm:<18} x{self.gains['algorithm']:.2f} vs ring",
                f"  wire_dtype   = {self.wire_dtype:<18} x{self.gains['wire_dtype']:.2f} "
                "vs float32",
                f"  step {self.result.iteration_time * 1e3:.2f} ms vs "
                f"{self.baseline.iteration_time * 1e3:.2f} ms (x{self.speedup:.2f}); "
                f"scaling efficiency {self.baseline.scaling_efficiency:.0%} -> "
                f"{self.result.scaling_efficiency:.0%}",
            ]
        )


def plan(
    grads_or_shapes,
    cluster: Cluster,
    *,
    backward_time: float = 0.0,
    forward_time: float = 0.0,
    batch: int = 1,
    overlap: bool = True,
    double_buffering: bool = False,
    bucket_bytes=DEFAULT_BUCKET_BYTES,
    wire_dtypes=DEFAULT_WIRE_DTYPES,
    algorithms=DEFAULT_ALGORITHMS,
) -> Plan:
    """Recommends bucket size, algorithm and wire dtype for a gradient pytree on a cluster.

    Args:
      grads_or_shapes: a :class:`Workload` (e.g. from a profile's ``workload``),
        or a gradient pytree whose leaves are arrays, ``jax.ShapeDtypeStruct``
        or shape tuples, in tree order (backward produces them reversed).
      cluster: the cluster to plan for.
      backward_time: seconds of backward per step, for a pytree; spread over
        the leaves in proportion to their sizes. 0 leaves nothing to overlap.
      forward_time: seconds of forward per step, for a pytree.
      batch: examples per GPU per step, for a pytree (throughput only).
      overlap: whether buckets start as soon as their gradients exist.
      double_buffering: whether communication hides under the next step.
      bucket_bytes: candidate thresholds θ.
      wire_dtypes: candidate wire dtypes; on equal predicted time the earlier wins.
      algorithms: candidate algorithms.

    Returns:
      A :class:`Plan`; ``print`` it for a summary.
    """
    workload = _as_workload(grads_or_shapes, backward_time, forward_time, batch)
    if not (bucket_bytes and wire_dtypes and algorithms):
        raise ValueError("bucket_bytes, wire_dtypes and algorithms need a candidate each")

    def settings(theta, algorithm, wire):
        return Settings(
            wire_dtype=wire,
            bucket_bytes=theta,
            overlap=overlap,
            double_buffering=double_buffering,
            algorithm=algorithm,
        )

    def step(theta, algorithm, wire):
        return simulate(workload, cluster, settings(theta, algorithm, wire))

    # An FP8, int8 or int4 wire has one schedule of its own: tried once, under "ring".
    candidates = [
        c
        for c in itertools.product(algorithms, wire_dtypes, bucket_bytes)
        if c[0] == "ring" or not Settings(wire_dtype=c[1]).scaled
    ]
    if not candidates:
        raise ValueError(
            "an FP8, int8 or int4 wire_dtypes candidate needs 'ring' among the algorithms"
        )
    best = min(candidates, key=lambda c: step(c[2], c[0], c[1]).iteration_time)
    algorithm, wire, theta = best
    baseline = step(0.0, "ring", "float32")

    def gain(**revert):
        args = {"theta": theta, "algorithm": algorithm, "wire": wire, **revert}
        return step(**args).iteration_time / recommended.iteration_time

    recommended = step(theta, algorithm, wire)
    return Plan(
        bucket_bytes=theta,
        algorithm=algorithm,
        wire_dtype=str(wire),
        settings=settings(theta, algorithm, wire),
        result=recommended,
        baseline=baseline,
        gains={
            "bucket_bytes": gain(theta=0.0),
            "algorithm": gain(algorithm="ring"),
            "wire_dtype": gain(wire="float32"),
        },
        cluster=cluster,
        tensors=len(workload.tensors),
        nbytes=workload.elements * GRADIENT_ITEMSIZE,
    )


def _as_workload(tree, backward_time, forward_time, batch) -> Workload:
    if isinstance(tree, Workload):
        return tree
    leaves = jax.tree.leaves(tree, is_leaf=_is_shape)
    if not leaves:
        raise ValueError("no gradient leaves to plan for")
    shapes = [tuple(int(d) for d in (leaf if _is_shape(leaf) else leaf.shape)) for leaf in leaves]
    sizes = [math.prod(shape) for shape in shapes]
    total = sum(sizes)
    if total == 0:
        raise ValueError("gradients have no elements")
    tensors = tuple(
        GradientTensor(size, backward_time * size / total, shape=shape)
        for size, shape in zip(reversed(sizes), reversed(shapes), strict=True)
    )
    return Workload(tensors, forward_time=forward_time, batch=batch)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"
