"""Does XLA's CPU runtime compute while a custom call waits? One CPU device, one process.

A double-buffered step hides the exchange only if the runtime runs this
step's forward and backward while last step's gradient travels. Across
processes XLA's own collectives do not let it (``python bench/network.py
--workload overlap``: a psum and an independent matmul chain take the sum of
their times). This isolates why: a custom call that stands for a transfer
waits ``--wait`` seconds next to an independent chain of matmuls, either
blocking the thread XLA runs it on (as XLA's gloo collectives do) or
returning an ``ffi::Future`` and waiting on a thread of its own (as
jaxcomm's CPU handlers do). It prints the median of ``--rounds`` timings of
each program, and how much of the shorter part was hidden:
``(compute + wait - both) / min(compute, wait)``, 1 for full overlap, 0 for
none. A third program holds two independent waits, to see whether the
runtime runs two custom calls at once.

The waiting handlers are test-only (``jaxcomm._ffi_testing``, built by
default; see CMakeLists.txt).

    python bench/overlap.py
    python bench/overlap.py --wait 0.2 --matmuls 16 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wait", type=float, default=0.5, help="seconds each call waits")
    parser.add_argument("--matmuls", type=int, default=8, help="1024x1024 matmuls in the chain")
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from jaxcomm import _ffi_testing
    except ImportError:
        print("overlap: jaxcomm._ffi_testing is not built (JAXCOMM_TESTING=ON)", file=sys.stderr)
        return 1
    for name, capsule in _ffi_testing.wait_handlers().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")

    def wait(x, target, tag):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return call(x, seconds=np.float64(args.wait), tag=np.int64(tag))

    def compute(m):
        for _ in range(args.matmuls):
            m = jnp.tanh(m @ m)
        return m

    x = jnp.ones(1024, jnp.float32)
    m = jnp.full((1024, 1024), 1 / 1024, jnp.float32)
    kinds = {"blocking": "jaxcomm_testing_wait", "future": "jaxcomm_testing_wait_async"}
    programs = {"compute": (jax.jit(compute), (m,))}
    for kind, target in kinds.items():
        programs[f"{kind} wait"] = (jax.jit(lambda x, t=target: wait(x, t, 1)), (x,))
        programs[f"{kind} wait + compute"] = (
            jax.jit(lambda x, m, t=target: (wait(x, t, 1), compute(m))),
            (x, m),
        )
        programs[f"{kind} wait x2"] = (
            jax.jit(lambda x, t=target: (wait(x, t, 1), wait(x + 1, t, 2))),
            (x,),
        )
    times: dict[str, list[float]] = {name: [] for name in programs}
    for fn, fn_args in programs.values():
        jax.block_until_ready(fn(*fn_args))  # compile
    for r in range(args.rounds):
        print(f"overlap: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name, (fn, fn_args) in programs.items():  # alternating: same load for all
            start = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'program':<26}{'median s':>10}{'hidden':>9}")
    for name, t in median.items():
        hidden = ""
        if name.endswith("+ compute"):
            alone = median[name.replace(" + compute", "")]
            saved = median["compute"] + alone - t
            hidden = f"{saved / min(median['compute'], alone):.2f}"
        elif name.endswith("x2"):
            alone = median[name.replace(" x2", "")]
            hidden = f"{(2 * alone - t) / alone:.2f}"
        print(f"{name:<26}{t:>10.3f}{hidden:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
