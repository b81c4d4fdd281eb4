"""Fit α and β of the ring model to allreduce times measured on the live mesh.

The ring model says an allreduce of ``n`` bytes over ``p`` ranks takes
``t(n) = a + b·n`` with ``a = 2(p-1)α`` and ``b = 2(p-1)/p·β``. Any algorithm
whose time is affine in ``n`` fits that form; α and β are then that
algorithm's ring-equivalent latency and time per byte, and
``1/β`` is the bus bandwidth (nccl-tests' busbw) at large sizes.

The fit minimises the *relative* squared error, ``Σ ((a + b·n_i - t_i) / t_i)²``,
so the small, latency-bound sizes count as much as the large ones; a
coefficient that would come out negative is pinned to 0 and the other refitted.

Examples:
  >>> f = fit_alpha_beta([1e3, 1e6, 1e9], [1.4e-5 + 1.75e-6, 1.4e-5 + 1.75e-3, 1.4e-5 + 1.75],
  ...                    p=8)
  >>> round(f.alpha * 1e6, 6), round(f.beta * 1e9, 6)  # 1 us, 1 ns/byte (1 GB/s)
  (1.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Sequence

import numpy as np

from jaxcomm.costmodel.alphabeta import check_ranks, ring_allreduce_time
from jaxcomm.costmodel.cluster import Cluster, cpu_host
from jaxcomm.costmodel.timing import time_rounds

AXIS = "costmodel_fit"


@dataclasses.dataclass(frozen=True)
class LinkFit:
    """α (s per step) and β (s per byte) of the ring model for ``p`` ranks."""

    alpha: float
    beta: float
    p: int

    def predict(self, nbytes: float) -> float:
        """Predicted allreduce seconds for ``nbytes`` per rank."""
        return ring_allreduce_time(nbytes, p=self.p, alpha=self.alpha, beta=self.beta)

    @property
    def busbw(self) -> float:
        """Bus bandwidth at large sizes, bytes/s: 1/β."""
        return 1 / self.beta if self.beta > 0 else float("inf")


def fit_alpha_beta(nbytes: Sequence[float], times: Sequence[float], *, p: int) -> LinkFit:
    """Fits the ring model's α and β to measured allreduce times.

    Args:
      nbytes: message size per rank of each measurement.
      times: seconds of each measurement (> 0).
      p: ranks in the allreduce (>= 2).

    Returns:
      The :class:`LinkFit`.
    """
    p = check_ranks("p", p)
    if p < 2:
        raise ValueError("p=1 moves no data: nothing to fit")
    n = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.ndim != 1 or n.shape != t.shape or n.size < 2:
        raise ValueError("need two or more (nbytes, time) pairs of equal length")
    if np.any(n < 0) or np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError("sizes must be >= 0 and times finite and > 0")
    if np.unique(n).size < 2:
        raise ValueError("need at least two different sizes")
    intercept, slope = _relative_least_squares(n, t)
    steps = 2 * (p - 1)
    return LinkFit(alpha=intercept / steps, beta=slope * p / steps, p=p)


def _relative_least_squares(n: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """min Σ ((a + b n - t)/t)² over a, b >= 0."""
    design = np.stack([1 / t, n / t], axis=1)  # each row divided by t_i
    target = np.ones_like(t)
    (a, b), *_ = np.linalg.lstsq(design, target, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    if a < 0:  # through the origin: b = Σ(n/t) / Σ(n/t)²
        return 0.0, float(np.sum(n / t) / np.sum((n / t) ** 2))
    return float(np.sum(1 / t) / np.sum(1 / t**2)), 0.0


def measure_allreduce(
    nbytes: Sequence[int],
    *,
    backend: str = "xla",
    algorithm: str = "auto",
    reps: int = 10,
    warmup: int = 2,
    statistic: str = "median",
) -> list[float]:
    """Seconds of a float32 sum ``jaxcomm.allreduce`` over all devices, per size.

    Each size gets its own ``jax.jit(jax.shard_map(...))`` over a 1-D mesh of
    ``jax.devices()``. The sizes are timed in interleaved rounds (one call of
    every size per round, the order rotated each round), so that a passing
    burst of other work on the machine disturbs all sizes alike rather than
    one. Every call is waited for before the next starts: only one step is ever
    in flight, which XLA's CPU collectives require (see
    :func:`~jaxcomm.costmodel.time_rounds`, which times them).

    Args:
      nbytes: message size per device, a multiple of 4 bytes.
      backend: ``jaxcomm.allreduce``'s backend.
      algorithm: ``jaxcomm.allreduce``'s algorithm.
      reps: timed rounds.
      warmup: untimed rounds after compiling.
      statistic: ``"median"`` or ``"min"`` of each size's timed calls (the
        minimum is the undisturbed time on a shared machine).
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    reduce = {"median": statistics.median, "min": min}.get(statistic)
    if reduce is None:
        raise ValueError(f"statistic={statistic!r} must be 'median' or 'min'")
    for size in nbytes:
        if size <= 0 or size % 4:
            raise ValueError(f"size {size} must be a positive multiple of 4 bytes")
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), (AXIS,))
    fn = jax.jit(
        jax.shard_map(
            lambda x: jaxcomm.allreduce(x, AXIS, backend=backend, algorithm=algorithm),
            mesh=mesh,
            in_specs=P(AXIS),
            out_specs=P(AXIS),
        )
    )
    sharding = NamedSharding(mesh, P(AXIS))
    inputs = [
        jax.device_put(np.ones(len(devices) * (size // 4), np.float32), sharding) for size in nbytes
    ]
    calls = [functools.partial(fn, x) for x in inputs]
    samples = time_rounds(calls, reps=reps, warmup=warmup + 1)  # the first round compiles
    return [reduce(times) for times in samples]


def fit_cluster(
    nbytes: Sequence[int] = (4 << 10, 64 << 10, 1 << 20, 4 << 20),
    *,
    backend: str = "xla",
    algorithm: str = "auto",
    reps: int = 10,
) -> tuple[Cluster, LinkFit]:
    """Measures allreduce on all devices and returns the fitted one-node cluster and fit."""
    import jax

    times = measure_allreduce(nbytes, backend=backend, algorithm=algorithm, reps=reps)
    fit = fit_alpha_beta(nbytes, times, p=jax.device_count())
    return cpu_host(devices=fit.p, alpha=fit.alpha, beta=fit.beta), fit
