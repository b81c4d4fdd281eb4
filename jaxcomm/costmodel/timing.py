"""Wall-clock timing of jitted calls, one call in flight at a time.

Every measurement in jaxcomm and its benchmarks goes through these two
functions, so they all mean the same thing: the seconds from dispatching one
call to its result being ready (``jax.block_until_ready``). Each call is waited
for before the next starts: XLA's CPU collectives can abort when several steps
that contain them overlap, and a number that includes the wait is the one a
training loop that reads its loss every step sees.

Several functions timed together run in interleaved rounds, one call of each per
round with the order rotated every round, so that a passing burst of other work
on the machine disturbs them alike; with two functions that alternates which
goes first. The caller reduces the samples: the median is the benchmarks'
figure, the minimum the undisturbed time on a shared machine.

Examples:
  >>> import jax.numpy as jnp
  >>> samples = time_rounds([lambda: jnp.ones(4) * 2, lambda: jnp.zeros(8)], reps=3)
  >>> [len(s) for s in samples]
  [3, 3]
  >>> time_call(lambda: jnp.ones(4)) > 0
  True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def time_call(fn: Callable[[], object]) -> float:
    """Seconds of one ``fn()`` up to its result being ready.

    The result is dropped before returning, so its buffers can be freed before
    the next call.

    Args:
      fn: a function of no arguments returning JAX arrays (any pytree).
    """
    import jax

    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    elapsed = time.perf_counter() - start
    del out
    return elapsed


def time_rounds(
    fns: Sequence[Callable[[], object]], *, reps: int, warmup: int = 2
) -> list[list[float]]:
    """Times every function in ``fns`` in interleaved rounds, one call in flight.

    Round ``r`` calls ``fns[(r + k) % len(fns)]`` for ``k = 0, 1, ...``: every
    function once, the order rotated each round. The first ``warmup`` rounds are
    not timed; the first call of a function not yet compiled compiles it, so
    count that round here unless the function was called before.

    Args:
      fns: functions of no arguments, as for :func:`time_call`.
      reps: timed rounds (>= 1).
      warmup: untimed rounds before them (>= 0).

    Returns:
      One list per function, in the order of ``fns``, of its ``reps`` timed
      calls in seconds.
    """
    if reps < 1:
        raise ValueError(f"reps={reps} must be >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    samples: list[list[float]] = [[] for _ in fns]
    for round_ in range(warmup + reps):
        for k in range(len(fns)):
            i = (round_ + k) % len(fns)
            seconds = time_call(fns[i])
            if round_ >= warmup:
                samples[i].append(seconds)
    return samples
