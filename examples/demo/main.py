"""Data-parallel MLP training on 8 CPU devices with jaxcomm's allreduce.

Usage::

    python examples/demo/main.py
    python examples/demo/main.py --backend xla --wire-dtype float16 --compare
"""

from __future__ import annotations

import os

# Must happen before jax is imported: the CPU device count is fixed at startup.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402


def parse_args(argv=None) -> tuple[train.Config, bool]:
    """Parses command-line flags into a ``train.Config``, plus ``--compare``."""
    defaults = train.Config()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("auto", "xla", "ffi"), default=defaults.backend)
    p.add_argument("--wire-dtype", choices=tuple(train.WIRE_DTYPES), default=defaults.wire_dtype)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch", type=int, default=defaults.batch, help="global batch size")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--compare",
        action="store_true",
        help="also train with jax.lax.pmean and compare accuracies and parameters",
    )
    args = p.parse_args(argv)
    config = train.Config(
        backend=args.backend,
        wire_dtype=args.wire_dtype,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
    )
    return config, args.compare


def _report(name, result):
    """Prints the accuracy, step time and wire bytes of one run."""
    print(f"{name}: test accuracy {result['test_accuracy']:.4f}")
    print(f"{name}: mean step time {result['step_time_s'] * 1e3:.2f} ms (first step excluded)")
    if result["bytes_per_step"] is None:
        sent = f"n/a ({result['backend']} backend)"
    else:
        sent = f"{result['bytes_per_step']:,.0f} bytes"
    print(f"{name}: sent per device per step {sent}")


def main(argv=None):
    """Trains with jaxcomm (and, with ``--compare``, with ``lax.pmean``) and prints metrics."""
    config, compare = parse_args(argv)
    print(
        f"{jax.device_count()} devices, backend={config.backend}, "
        f"wire_dtype={config.wire_dtype}, steps={config.steps}, batch={config.batch}"
    )
    start = time.perf_counter()
    result = train.train(config)
    print(f"jaxcomm ({result['backend']}) finished in {time.perf_counter() - start:.1f} s")
    _report("jaxcomm", result)

    if compare:
        print("reference: jax.lax.pmean")
        ref = train.train(dataclasses.replace(config, reduce="pmean"))
        _report("pmean", ref)
        diffs = jax.tree.map(
            lambda a, b: float(np.max(np.abs(a - b))), result["params"], ref["params"]
        )
        close = all(
            jax.tree.leaves(
                jax.tree.map(
                    lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6),
                    result["params"],
                    ref["params"],
                )
            )
        )
        print(
            f"accuracy: jaxcomm {result['test_accuracy']:.4f} vs pmean {ref['test_accuracy']:.4f}"
        )
        print(
            f"final params match pmean to float32 tolerance (rtol=1e-5, atol=1e-6): {close}; "
            f"max |diff| {max(jax.tree.leaves(diffs)):.3g}"
        )


if __name__ == "__main__":
    main()
