"""Fit the ring model's α and β to allreduce times measured on 8 CPU devices, and check it.

For each backend (``ffi``: jaxcomm's custom call, its default ``direct``
algorithm; ``xla``: ``lax.psum``), a float32 sum ``jaxcomm.allreduce`` over 8 host
CPU devices is timed at every size with
``jaxcomm.costmodel.measure_allreduce`` (median of the timed calls, one call in
flight at a time, each waited for with ``block_until_ready``). α and β are fitted
with ``jaxcomm.costmodel.fit_alpha_beta`` (relative least squares) to every
other size, starting with the smallest; the sizes left out test the model on
data it was not fitted to. Printed per size: measured and predicted time, the
relative error ``(predicted - measured) / measured``, and whether the size was
held out.

Usage::

  python bench/fit_costmodel.py --json /tmp/fit.json      # also /tmp/fit.png
  python bench/fit_costmodel.py --sizes 4K,64K,1M,16M --reps 5

Default sizes: 4 KiB to 4 MiB per device in powers of 2.

JSON: ``{backend: {"alpha_s", "beta_s_per_byte", "busbw_GBps", "max_abs_rel_error",
"max_abs_rel_error_held_out", "rows": [{"size_bytes", "measured_s", "predicted_s",
"rel_error", "held_out"}]}}``. The plot (next to the JSON, same stem, ``.png``)
shows busbw (nccl-tests: size/time * 2(N-1)/N) against size, measured points and
the fitted model's line, per backend.
"""

import argparse
import json
import os
import pathlib
import sys

import _common
from _common import bus_factor_allreduce, format_size, parse_sizes, pyplot

_common.host_devices()  # before jax is imported

import jax  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm.costmodel import fit_alpha_beta, measure_allreduce  # noqa: E402

N = _common.HOST_DEVICES
# 4 KiB .. 4 MiB per device, powers of 2: the regime one alpha-beta line describes on
# the CPU host (see bench/README.md: from 8 MiB, memory and page faults take over).
DEFAULT_SIZES = [(4 << 10) << k for k in range(11)]
BACKENDS = ("ffi", "xla")


def fit_backend(backend: str, sizes: list[int], reps: int, statistic: str) -> dict:
    """Measures, fits on every other size, and returns the JSON entry."""
    times = measure_allreduce(sizes, backend=backend, reps=reps, statistic=statistic)
    fitted = [i % 2 == 0 for i in range(len(sizes))]
    fit = fit_alpha_beta(
        [s for s, f in zip(sizes, fitted, strict=True) if f],
        [t for t, f in zip(times, fitted, strict=True) if f],
        p=N,
    )
    rows = []
    for size, measured, used in zip(sizes, times, fitted, strict=True):
        predicted = fit.predict(size)
        rows.append(
            {
                "size_bytes": size,
                "measured_s": measured,
                "predicted_s": predicted,
                "rel_error": (predicted - measured) / measured,
                "held_out": not used,
            }
        )
    errors = [abs(r["rel_error"]) for r in rows]
    held_out = [abs(r["rel_error"]) for r in rows if r["held_out"]]
    return {
        "alpha_s": fit.alpha,
        "beta_s_per_byte": fit.beta,
        "busbw_GBps": fit.busbw / 1e9,
        "max_abs_rel_error": max(errors),
        "max_abs_rel_error_held_out": max(held_out) if held_out else None,
        "rows": rows,
    }


def print_backend(backend: str, entry: dict) -> None:
    print(
        f"\n{backend}: alpha = {entry['alpha_s'] * 1e6:.2f} us per step, "
        f"beta = {entry['beta_s_per_byte'] * 1e9:.4f} ns/B (busbw {entry['busbw_GBps']:.2f} GB/s)"
    )
    print(f"  {'size':>9} {'measured':>12} {'predicted':>12} {'error':>8}")
    for r in entry["rows"]:
        mark = "  (held out)" if r["held_out"] else ""
        print(
            f"  {format_size(r['size_bytes']):>9} {r['measured_s'] * 1e6:>10.1f}us "
            f"{r['predicted_s'] * 1e6:>10.1f}us {r['rel_error']:>+8.1%}{mark}"
        )
    held = entry["max_abs_rel_error_held_out"]
    held_text = "n/a" if held is None else f"{held:.1%}"
    print(f"  max |error| {entry['max_abs_rel_error']:.1%}, held-out sizes {held_text}")


def write_plot(path: pathlib.Path, results: dict) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    factor = bus_factor_allreduce(N)
    for backend, entry in results.items():
        rows = entry["rows"]
        sizes = [r["size_bytes"] for r in rows]
        measured = [r["size_bytes"] / r["measured_s"] * factor / 1e9 for r in rows]
        (line,) = ax.plot(sizes, measured, "o", label=f"{backend} measured")
        grid = np.geomspace(min(sizes), max(sizes), 100)
        alpha, beta = entry["alpha_s"], entry["beta_s_per_byte"]
        model = [s / (2 * (N - 1) * alpha + factor * s * beta) * factor / 1e9 for s in grid]
        ax.plot(grid, model, "-", color=line.get_color(), label=f"{backend} fitted model")
    ax.set(
        xscale="log",
        xlabel="bytes per device",
        ylabel="busbw (GB/s)",
        title=f"float32 allreduce on {N} CPU devices: measured vs alpha-beta fit",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"# plot: {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES, help="e.g. 4K,1M,16M")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per size")
    parser.add_argument(
        "--statistic",
        choices=("min", "median"),
        default="min",
        help="per size: fastest call (default; undisturbed by other work) or median",
    )
    parser.add_argument("--json", metavar="PATH", help="write results here, plot beside it")
    args = parser.parse_args(argv)
    if jax.device_count() != N:
        sys.exit(f"need {N} devices, found {jax.device_count()}")
    sizes = sorted(set(args.sizes))
    if len(sizes) < 3 or any(s % 4 for s in sizes):
        parser.error("need at least 3 sizes, multiples of 4 bytes")
    print(f"# jax {jax.__version__}, {N} x {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    print(
        f"# load average at start {os.getloadavg()[0]:.2f}; {args.statistic} of {args.reps} "
        "interleaved rounds"
    )
    print("# model: t = 2(N-1) alpha + 2(N-1)/N size beta, fitted to every other size")
    results = {}
    for backend in BACKENDS:
        if backend == "ffi" and not jaxcomm.ffi_available():
            print("# ffi backend not built: skipped", file=sys.stderr)
            continue
        print(f"# measuring {backend} ...", file=sys.stderr, flush=True)
        results[backend] = fit_backend(backend, sizes, args.reps, args.statistic)
        print_backend(backend, results[backend])
    if args.json:
        path = pathlib.Path(args.json)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"# wrote {path}")
        write_plot(path.with_suffix(".png"), results)


if __name__ == "__main__":
    main()
