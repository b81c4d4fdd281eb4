"""Allreduce benchmark: jaxcomm's CPU FFI allreduce against ``lax.psum`` and the memory roofline.

Runs on 8 host CPU devices (``--xla_force_host_platform_device_count=8``, set
before jax is imported unless ``XLA_FLAGS`` is already set) and, for each
message size, times a float32 sum allreduce over all 8 devices with:

  ffi        ``jaxcomm.allreduce(x, "i", backend="ffi", algorithm="direct")``
  ffi-ring   the same with ``algorithm="ring"`` (shows why direct is the default)
  psum       ``jax.lax.psum(x, "i")`` (XLA's own CPU collective)
  roofline   not run: the time the direct algorithm would take if it moved
             its bytes at the host's measured copy bandwidth (see below)

Each implementation is ``jax.jit(jax.shard_map(f, mesh, P("i"), P("i")))``
over ``jax.make_mesh((8,), ("i",))``; the input is a float32 array of shape
``(8 * count,)`` sharded with ``NamedSharding(mesh, P("i"))``, so every
device holds ``count = size // 4`` elements. ``size`` is the per-device
message size, as in nccl-tests.

Method, per size:

* Correctness: the first call of every implementation (which also compiles
  it) is compared on every device against a float64 numpy reference,
  ``x.reshape(8, -1).sum(0)``. Any mismatch ends the run with exit status 1.
* Warm-up: two more calls of every implementation.
* Timing: ``jaxcomm.costmodel.time_rounds``: ``time.perf_counter()`` around
  one call plus ``jax.block_until_ready`` on its result. Only one call is ever in flight
  (XLA's CPU collectives can abort when several steps overlap). The
  implementations are interleaved, in a rotating order, so that slow drift of
  the machine affects them alike. Repetitions are chosen from the warm-up
  times so that timing one size takes about ``--reps-time`` seconds (at
  least ``--min-reps``, at most 1000); the reported time is the median.
* Diagnostics, on stderr with the progress: the slowest/fastest ratio of
  the timed calls of each implementation (large on a busy machine), and the
  minor page faults of one call.

Page faults and huge pages. XLA's CPU runtime allocates every output afresh,
and from 32 MiB per device (glibc's largest mmap threshold) that memory
comes fresh from the kernel: each call faults in, and the kernel zeroes, its
whole output, 4 KiB at a time. That cost belongs to neither algorithm (psum
pays it alike) and the roofline leaves it out, but at 64 MiB it is more than
half of the time. So the benchmark runs with glibc's transparent huge pages
for its large allocations (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, glibc
2.35 or newer, with THP in ``madvise`` or ``always`` mode): the kernel then
faults 2 MiB at a time. It re-executes itself with that setting before jax
is imported, and says so in the header; ``--no-hugepages`` measures with
plain 4 KiB pages. The same setting speeds up any XLA CPU program with large
buffers.

Bandwidth follows the nccl-tests convention for allreduce with N ranks::

  algbw = size / time
  busbw = algbw * 2 (N - 1) / N

in GB/s (1e9 bytes/s). busbw is comparable across N and to the hardware's
bandwidth: a ring sends and receives 2 (N - 1) / N of the message per rank.

The roofline. Before the sweep the host's copy bandwidth B is measured with
numpy: min(cpu_count, 8) threads each ``np.copyto`` a 128 MiB float32 buffer
into another several times (numpy releases the GIL while copying); B = bytes
read + bytes written per second, best of 10 repetitions. With an n-byte
message per rank, the direct algorithm reads every rank's input once and
writes every rank's output once (the least any allreduce can move), so all
N ranks together move ``2 N n`` bytes (16 n for N = 8), and

  roofline_time = 2 N n / B.

The fraction of the roofline that ffi achieves is roofline_time / ffi_time.
The roofline bounds only messages whose working set (N inputs and N outputs)
is far larger than the caches; below that, caches beat memory and the
fraction can exceed 1.

Input. The sweep runs twice, one table each (``--input`` picks one):

  argument   every implementation reduces x itself, a jit argument. XLA
             must keep it, so each writes its result to a fresh buffer.
  gradient   every implementation reduces ``x * s`` (s a traced 1.0), made
             inside the step and dead after the allreduce, as a gradient is
             in training. ffi passes ``in_place=True``, so its result takes
             that buffer (``allreduce_gradients`` does so for its buckets);
             psum gets the same program and XLA's own buffer choices. The
             roofline also counts the step's read of x and write of x * s:
             ``4 N n`` bytes.

Targets, checked after each table and printed as PASS/FAIL lines naming
the input (they do not change the exit status): (1) ffi is no slower than psum at every size of at
least 1 MiB; (2) ffi reaches at least half the roofline at 64 MiB.

Usage::

  python bench/allreduce.py                       # 4 KiB .. 256 MiB, powers of 4
  python bench/allreduce.py --max-size 16M        # quick run
  python bench/allreduce.py --input gradient     # only the array made in the step
  python bench/allreduce.py --sizes 1M,64M --json out.json --plot out.png
"""

import argparse
import dataclasses
import functools
import gc
import json
import os
import resource
import statistics
import sys
import time

import _common
from _common import (
    bus_factor_allreduce,
    copy_bandwidth,
    format_size,
    parse_size,
    parse_sizes,
    power_of_4_sizes,
    pyplot,
    reps_for,
)

_common.host_devices()  # before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm.costmodel import time_call, time_rounds  # noqa: E402

N = _common.HOST_DEVICES
AXIS = "i"
TIMED = ("ffi", "psum", "ffi-ring")  # run and timed, interleaved
IMPLS = ("ffi", "ffi-ring", "psum", "roofline")  # reported
DEFAULT_SIZES = power_of_4_sizes(4 << 10, 256 << 20)
TARGET_MIN_SIZE = 1 << 20  # target (1): ffi <= psum from this size up
ROOFLINE_SIZE = 64 << 20  # target (2): ffi >= ROOFLINE_TARGET of the roofline here
ROOFLINE_TARGET = 0.5
HUGEPAGES = "glibc.malloc.hugetlb=1"  # GLIBC_TUNABLES entry, see the docstring
RTOL = ATOL = 1e-5  # 8 float32 values in [-1, 1): rounding error well below 1e-5


def build_impls(mesh, gradient: bool) -> dict:
    """The jitted shard_map allreduce of every timed implementation, as
    f(x, s): of x itself, or (``gradient``) of x * s, made inside the step."""
    bodies = {
        "ffi": lambda v: jaxcomm.allreduce(
            v, AXIS, backend="ffi", algorithm="direct", in_place=gradient
        ),
        "ffi-ring": lambda v: jaxcomm.allreduce(v, AXIS, backend="ffi", algorithm="ring"),
        "psum": lambda v: jax.lax.psum(v, AXIS),
    }

    def step(body):
        # s is an argument, so XLA cannot fold x * 1 away.
        return (lambda x, s: body(x * s)) if gradient else (lambda x, s: body(x))

    return {
        name: jax.jit(
            jax.shard_map(step(body), mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS))
        )
        for name, body in bodies.items()
    }


def roofline_bytes(size: int, gradient: bool, n: int = N) -> float:
    """Bytes read plus written by all ranks: the direct algorithm reads every
    input once and writes every output once; with ``gradient`` the step also
    reads x and writes x * s (see module docstring)."""
    return (4 if gradient else 2) * n * size


def use_hugepages() -> None:
    """Re-executes this process with glibc's huge pages, unless it has them."""
    if HUGEPAGES in os.environ.get("GLIBC_TUNABLES", ""):
        return
    # glibc reads its tunables only when a process starts.
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), HUGEPAGES]))
    env = {**os.environ, "GLIBC_TUNABLES": tunables}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def page_mode() -> str:
    """How large allocations get their pages, for the header."""
    if HUGEPAGES not in os.environ.get("GLIBC_TUNABLES", ""):
        return "glibc's default, 4 KiB pages"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        thp = "unknown"
    return f"GLIBC_TUNABLES={HUGEPAGES} (transparent huge pages: {thp})"


def busbw(size: int, seconds: float) -> float:
    """nccl-tests bus bandwidth in GB/s."""
    return size / seconds * bus_factor_allreduce(N) / 1e9


class Reference:
    """The float64 sum every device must hold, and the allowed error per element."""

    def __init__(self, host: np.ndarray):
        self.sum = host.reshape(N, -1).sum(0, dtype=np.float64)
        self.tol = np.abs(self.sum) * RTOL + ATOL  # np.allclose's tolerance
        self._scratch = np.empty_like(self.sum)

    def check(self, impl: str, out, size: int) -> None:
        """Exits with status 1 unless every device's result is close to the sum."""
        for shard in out.addressable_shards:
            got = np.asarray(shard.data)
            if got.shape != self.sum.shape:
                detail = f"shape {got.shape}, expected {self.sum.shape}"
            else:
                excess = self._scratch  # |got - sum| - tol, without allclose's temporaries
                np.subtract(got, self.sum, out=excess)
                np.abs(excess, out=excess)
                excess -= self.tol
                worst = int(excess.argmax())
                if excess[worst] <= 0:  # also false for NaN
                    continue
                detail = (
                    f"element {worst} is {got[worst]!r}, expected {self.sum[worst]!r} "
                    f"(+- {self.tol[worst]:.2g})"
                )
            where = f"{impl} allreduce of {format_size(size)} on {shard.device}"
            sys.exit(f"FAIL: {where} is wrong: {detail}")


@dataclasses.dataclass
class SizeResult:
    times: dict  # impl -> median seconds per call
    reps: int
    spread: dict  # impl -> slowest / fastest timed call
    faults: dict  # impl -> minor page faults during one warm-up call


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bench_size(
    fns: dict, mesh, size: int, reps_time: float, min_reps: int, rng: np.random.Generator
) -> SizeResult:
    """Checks and times every implementation at one per-device size."""
    count = size // 4
    host = rng.random(N * count, dtype=np.float32)
    host *= 2
    host -= 1
    reference = Reference(host)
    x = jax.block_until_ready(jax.device_put(host, NamedSharding(mesh, P(AXIS))))
    del host

    # Compile and check, then two warm-up calls; the last one estimates the
    # cost of a round of all implementations.
    one = jax.device_put(np.float32(1), NamedSharding(mesh, P()))
    calls = {impl: functools.partial(fns[impl], x, one) for impl in TIMED}
    round_s = 0.0
    faults = {}
    for impl in TIMED:
        out = jax.block_until_ready(calls[impl]())
        reference.check(impl, out, size)
        del out
        time_call(calls[impl])
        before = minor_faults()
        round_s += time_call(calls[impl])
        faults[impl] = minor_faults() - before
    del reference

    reps = reps_for(round_s, reps_time, lo=min_reps)
    # Interleaved, the order rotated each round; warmed up above.
    samples = time_rounds([calls[impl] for impl in TIMED], reps=reps, warmup=0)
    times = dict(zip(TIMED, samples, strict=True))
    del calls, x
    gc.collect()
    return SizeResult(
        times={impl: statistics.median(ts) for impl, ts in times.items()},
        reps=reps,
        spread={impl: max(ts) / min(ts) for impl, ts in times.items()},
        faults=faults,
    )


def print_header(file=sys.stdout) -> None:
    groups = "".join(f"{name:>20}" for name in ("ffi (direct)", "ffi-ring", "psum", "roofline"))
    print(f"#{'':>9}{groups}", file=file)
    cols = "".join(f"{'time(us)':>11}{'busbw':>9}" for _ in range(4))
    print(f"#{'size':>9}{cols}{'ffi/psum':>10}{'ffi/roof':>10}", file=file)
    units = "".join(f"{'':>11}{'(GB/s)':>9}" for _ in range(4))
    print(f"#{'':>9}{units}{'(time)':>10}{'(frac)':>10}", file=file)


def print_row(size: int, times: dict, file=sys.stdout) -> None:
    cols = "".join(
        f"{times[impl] * 1e6:11.1f}{busbw(size, times[impl]):9.2f}"
        for impl in ("ffi", "ffi-ring", "psum", "roofline")
    )
    ratio = times["ffi"] / times["psum"]
    frac = times["roofline"] / times["ffi"]
    print(f"{format_size(size):>10}{cols}{ratio:10.2f}{frac:10.2f}", file=file, flush=True)


def target_checks(results: dict) -> list[str]:
    """The PASS/FAIL lines for the two performance targets."""
    lines = []
    big = [s for s in results if s >= TARGET_MIN_SIZE]
    if big:
        ratios = {s: results[s]["ffi"] / results[s]["psum"] for s in big}
        worst = max(ratios, key=ratios.get)
        ok = all(r <= 1.0 for r in ratios.values())
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: ffi time <= psum time for every size >= "
            f"{format_size(TARGET_MIN_SIZE)} (worst ffi/psum = {ratios[worst]:.2f} "
            f"at {format_size(worst)})"
        )
    else:
        lines.append(f"SKIP: ffi <= psum (no size >= {format_size(TARGET_MIN_SIZE)} measured)")
    if ROOFLINE_SIZE in results:
        t = results[ROOFLINE_SIZE]
        frac = t["roofline"] / t["ffi"]
        ok = frac >= ROOFLINE_TARGET
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: ffi reaches >= {ROOFLINE_TARGET} of the roofline at "
            f"{format_size(ROOFLINE_SIZE)} (got {frac:.2f})"
        )
    else:
        lines.append(f"SKIP: roofline fraction ({format_size(ROOFLINE_SIZE)} not measured)")
    return lines


def write_json(path: str, results: dict) -> None:
    """results: input kind -> size -> impl -> seconds. One row per (input, size, impl)."""
    rows = [
        {
            "impl": impl,
            "input": kind,
            "size_bytes": size,
            "time_s": times[impl],
            "busbw_GBps": busbw(size, times[impl]),
        }
        for kind, by_size in results.items()
        for size, times in by_size.items()
        for impl in IMPLS
    ]
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"# wrote {path}")


def write_plot(path: str, results: dict) -> None:
    """busbw against size, one panel per input kind."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    styles = {"ffi": "o-", "ffi-ring": "s-", "psum": "^-", "roofline": "k--"}
    for ax, (kind, by_size) in zip(axes[0], results.items(), strict=True):
        sizes = sorted(by_size)
        for impl in IMPLS:
            ax.plot(sizes, [busbw(s, by_size[s][impl]) for s in sizes], styles[impl], label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45)
        ax.set_xlabel("message size per device")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"float32 sum allreduce, {N} CPU devices; input: {kind}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"# wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=DEFAULT_SIZES,
        help="comma-separated per-device message sizes, e.g. 4K,1M,64M (default: 4K..256M, x4)",
    )
    parser.add_argument(
        "--max-size", type=parse_size, default=None, help="drop sizes above this, e.g. 16M"
    )
    parser.add_argument(
        "--no-hugepages",
        action="store_true",
        help="keep glibc's 4 KiB pages for large allocations (see 'Page faults' above)",
    )
    parser.add_argument(
        "--input",
        choices=("both", *INPUTS),
        default="both",
        help="reduce a jit argument, x * s made inside the step as a gradient is (which ffi "
        "reduces in place), or both, one table each (see 'Input' above; default: both)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as a list of rows")
    parser.add_argument("--plot", metavar="PATH", help="write a busbw-vs-size plot (matplotlib)")
    parser.add_argument(
        "--reps-time",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="target timing time per size; sets the repetitions (default: 1.0)",
    )
    parser.add_argument(
        "--min-reps",
        type=int,
        default=5,
        help="fewest timed repetitions per size, however slow (default: 5)",
    )
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes if args.max_size is None or s <= args.max_size]
    bad = [s for s in sizes if s % 4]
    if bad:
        parser.error(f"sizes must be multiples of 4 bytes (float32): {bad}")
    if not sizes:
        parser.error("no sizes left to measure")
    args.sizes = sorted(set(sizes))
    return args


INPUTS = {
    "argument": "x, a jit argument",
    "gradient": "x * s, made in the step (a gradient); ffi reduces it in place",
}


def sweep(mesh, sizes, gradient: bool, bandwidth: float, args) -> dict:
    """Checks and times every size for one kind of input; prints the table."""
    fns = build_impls(mesh, gradient)
    print(
        f"# input: {INPUTS['gradient' if gradient else 'argument']}; "
        f"roofline = {roofline_bytes(1, gradient)} * size / copy bandwidth"
    )
    print(f"# 1-minute load average at start: {os.getloadavg()[0]:.2f} (other work skews timings)")
    print_header()
    rng = np.random.default_rng(0)
    results = {}
    for i, size in enumerate(sizes, 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(sizes)}] {format_size(size)} ...", file=sys.stderr, flush=True)
        result = bench_size(fns, mesh, size, args.reps_time, args.min_reps, rng)
        times = dict(result.times, roofline=roofline_bytes(size, gradient) / bandwidth)
        results[size] = times
        print_row(size, times)
        spread = ", ".join(f"{impl} {result.spread[impl]:.2f}" for impl in TIMED)
        faults = ", ".join(f"{impl} {result.faults[impl]}" for impl in TIMED)
        print(
            f"[{i}/{len(sizes)}] {format_size(size)}: {result.reps} reps in "
            f"{time.perf_counter() - t0:.1f} s; slowest/fastest: {spread}; "
            f"page faults per call: {faults}",
            file=sys.stderr,
            flush=True,
        )
    kind = "gradient" if gradient else "argument"
    for line in target_checks(results):
        print(f"{line} [input: {kind}]")
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    if argv is None and not args.no_hugepages:
        use_hugepages()
    if jax.device_count() != N:
        sys.exit(
            f"need {N} devices, found {jax.device_count()}; run without XLA_FLAGS or with "
            f"--xla_force_host_platform_device_count={N}"
        )
    mesh = jax.make_mesh((N,), (AXIS,))
    threads = min(os.cpu_count() or 1, N)
    bandwidth, threads = copy_bandwidth(threads=threads)
    print(
        f"# jax {jax.__version__}, jaxcomm {jaxcomm.__version__}, "
        f"{N} x {jax.devices()[0].platform} devices, {os.cpu_count()} CPUs"
    )
    print(f"# copy bandwidth (read+write, {threads} threads): {bandwidth / 1e9:.2f} GB/s")
    print(f"# malloc: {page_mode()}")
    print("# float32 sum, time = median per call; busbw = size/time * 2(N-1)/N")
    inputs = list(INPUTS) if args.input == "both" else [args.input]
    start = time.perf_counter()
    results = {}
    for kind in inputs:
        print()
        results[kind] = sweep(mesh, args.sizes, kind == "gradient", bandwidth, args)
    print(f"# total {time.perf_counter() - start:.0f} s")
    if args.json:
        write_json(args.json, results)
    if args.plot:
        write_plot(args.plot, results)


if __name__ == "__main__":
    main()
