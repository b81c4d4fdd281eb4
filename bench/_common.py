"""Helpers shared by the collective benchmarks in ``bench/``.

Nothing here imports jax: a benchmark must set ``XLA_FLAGS`` before jax is
imported (:func:`host_devices`), and importing this module first must not
get in the way. Timing
itself is ``jaxcomm.costmodel.time_call`` / ``time_rounds``, shared with the
cost model's own measurements.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

HOST_DEVICES = 8  # the CPU benchmarks' devices, one process


def host_devices(count: int = HOST_DEVICES) -> None:
    """Has jax make ``count`` CPU devices, unless ``XLA_FLAGS`` is set already
    (a test session's, or the caller's own); call it before jax is imported.

    Args:
      count: host platform devices, ``--xla_force_host_platform_device_count``.

    Example::

      import _common

      _common.host_devices()
      import jax  # noqa: E402
    """
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={count}")


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Parses ``"4096"``, ``"4K"``, ``"16M"``, ``"1G"`` (binary units; a
    trailing ``"B"`` or ``"iB"`` is allowed) into bytes."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1:] if s[-1:] in _UNITS else ""
    number = s[: len(s) - len(unit)]
    try:
        value = int(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 4K, 16M, 1G)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    """Parses a comma-separated list of sizes, e.g. ``"4K,1M,64M"``."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(nbytes: int) -> str:
    """``4096 -> "4 KiB"``, ``1 << 20 -> "1 MiB"``; non-round sizes in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def power_of_4_sizes(lo: int, hi: int) -> list[int]:
    """``lo, 4*lo, 16*lo, ...`` up to and including ``hi``."""
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        size *= 4
    return sizes


def bus_factor_allreduce(n: int) -> float:
    """nccl-tests: allreduce busbw = algbw * 2(n-1)/n."""
    return 2 * (n - 1) / n


def reps_for(seconds_per_round: float, target_s: float, lo: int = 3, hi: int = 1000) -> int:
    """Repetitions so that timing takes about ``target_s``, clamped to ``[lo, hi]``."""
    if seconds_per_round <= 0:
        return hi
    return max(lo, min(hi, int(target_s / seconds_per_round)))


def copy_bandwidth(
    threads: int | None = None,
    buffer_bytes: int = 128 << 20,
    copies: int = 4,
    reps: int = 10,
) -> tuple[float, int]:
    """Measures the host's multi-threaded memory copy bandwidth.

    Each of ``threads`` Python threads owns a float32 source and destination
    of ``buffer_bytes`` each (far larger than any cache) and ``np.copyto``s
    one into the other ``copies`` times; numpy releases the GIL while
    copying, so the threads run in parallel. Bandwidth counts the bytes read
    plus the bytes written, ``2 * threads * copies * buffer_bytes``, over the
    wall time from a common start to the last thread's end. Returns the best
    of ``reps`` repetitions in bytes/s, and the thread count used
    (default: all CPUs).
    """
    threads = threads or os.cpu_count() or 1
    count = buffer_bytes // 4
    # np.full writes every page, so no page faults land in the timed region.
    buffers = [
        (np.full(count, 1.0, np.float32), np.full(count, 2.0, np.float32)) for _ in range(threads)
    ]

    def run_once() -> float:
        barrier = threading.Barrier(threads + 1)

        def worker(src: np.ndarray, dst: np.ndarray) -> None:
            barrier.wait()
            for _ in range(copies):
                np.copyto(dst, src)

        workers = [threading.Thread(target=worker, args=pair) for pair in buffers]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        return time.perf_counter() - t0

    run_once()  # warm up: threads, allocator, TLB
    best = min(run_once() for _ in range(reps))
    moved = 2 * threads * copies * buffer_bytes
    return moved / best, threads


def carried(run: list, *inputs):
    """A call of ``run = [step, *state]`` that carries on from its own result:
    each call is ``step(*state, *inputs)``, whose outputs become the next
    call's state (``run[1:]``), so timed steps follow one another
    (``time_rounds``) as in training.

    Args:
      run: the step function, then its state; updated in place.
      inputs: the same trailing arguments every call (the gradients).

    Example:
      >>> run = [lambda n, total, step: (n + step, total + n), 1, 0]
      >>> call = carried(run, 10)
      >>> call(), call()
      ([11, 1], [21, 12])
    """

    def call():
        run[1:] = run[0](*run[1:], *inputs)
        return run[1:]

    return call


def pyplot(path):
    """``matplotlib.pyplot`` drawing to files, or None, with a note on stderr
    that no plot goes to ``path``, where matplotlib is not installed (the
    benchmarks run without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"# matplotlib is not installed: no plot {path}", file=sys.stderr)
        return None
    return plt
