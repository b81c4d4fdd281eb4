"""Which backend and which schedule a collective runs: 'auto' resolved.

Resolution happens in two stages because JAX starts its backends on first
use, which jax.distributed.initialize must precede: what needs no platform is
decided (and checked) when a transform is built, the rest at trace time.
"""

from __future__ import annotations

import functools
import warnings

import jax

from jaxcomm.collectives import _checks, _ffi, _fp8


def known_backend(
    backend: str, *, masked: bool = False, narrow: bool = False, fp8: bool = False
) -> str:
    """The backend as far as it is decided without the platform: 'auto' is
    'xla' for a collective in the input's dtype and for an FP8 wire (only
    the xla backend has its schedule), and stays 'auto' with a chunk mask or
    a 16-bit wire. An 'ffi' here has not been checked for its handler yet."""
    _checks.check_choice("backend", backend, _checks.BACKENDS)
    return "xla" if backend == "auto" and (fp8 or not (masked or narrow)) else backend


def resolve_backend(
    backend: str, *, masked: bool = False, narrow: bool = False, fp8: bool = False
) -> str:
    """'auto' is 'xla' for a collective in the input's dtype: on CPU lax.psum
    is as fast as the ffi direct schedule from 16 MiB up and faster below
    (bench/allreduce.py). It is 'ffi' where available with a chunk mask (the
    only backend that sends just the selected chunks without a static
    bound) and with a 16-bit wire (XLA's CPU all-reduce adds float16 in
    float16, at 2-2.5x the step time of ffi's float32 adds in
    bench/overhead.py, and widens bfloat16 to float32)."""
    backend = known_backend(backend, masked=masked, narrow=narrow, fp8=fp8)
    if backend == "auto":
        # Across processes on CPU the ffi handlers run over TCP, which has not
        # been compared with gloo widely enough to be the default. On GPU the
        # CUDA handlers have run on one GPU only (tools/gpu_check.sh), never
        # across GPUs, so 'auto' does not choose them: xla packs under a bound.
        single = jax.process_count() == 1
        on_cpu = jax.default_backend() == "cpu"
        return "ffi" if single and on_cpu and _ffi.available() else "xla"
    if backend == "ffi":
        _ffi.require()
        if jax.default_backend() == "gpu":
            _warn_gpu_unverified()
    return backend


@functools.cache
def _warn_gpu_unverified() -> None:
    warnings.warn(
        "backend='ffi' on GPU: jaxcomm's CUDA handlers have run on one GPU only "
        "(tools/gpu_check.sh); their NCCL transport across GPUs or processes has "
        "never run. Compare with backend='xla' before you rely on it.",
        UserWarning,
        stacklevel=4,
    )


def check_algorithm(algorithm: str, backend: str, axes: tuple) -> None:
    """The algorithm checks that need no platform (backend may still be
    'auto'), so they can run when a transform is built."""
    _checks.check_choice("algorithm", algorithm, _checks.ALGORITHMS)
    if algorithm == "hierarchical" and len(axes) != 2:
        raise ValueError(
            f"algorithm='hierarchical' needs axis_name=(inter_axis, intra_axis), got {axes!r}"
        )
    if algorithm == "direct" and backend == "xla":
        raise ValueError(
            "algorithm='direct' is the shared-memory schedule of backend='ffi'; "
            "with backend='xla' use 'auto' (lax.psum), 'ring' or 'hierarchical'"
        )


def resolve_algorithm(
    algorithm: str, backend: str, axes: tuple, *, narrow: bool = False, fp8: bool = False
) -> str:
    """`backend` is resolved ('xla' or 'ffi'); `narrow`: a 16-bit wire;
    `fp8`: an 8-bit one, whose only schedule is _fp8's."""
    check_algorithm(algorithm, backend, axes)
    if fp8:
        return _fp8.ALGORITHM
    if algorithm == "auto":
        if backend == "ffi":
            # On one host the direct schedule beats the ring (bench/allreduce.py).
            return "direct"
        if narrow and jax.process_count() > 1 and jax.default_backend() == "cpu":
            # Across processes on CPU, lax.psum runs in gloo, which adds
            # float16 slowly and gets bfloat16 widened to float32 by XLA; the
            # ring sends 16 bits and adds in float32 (bench/network.py).
            return "ring"
        return "psum"  # XLA picks its own all-reduce algorithm
    if algorithm == "hierarchical" and backend == "xla" and jax.process_count() > 1:
        if jax.default_backend() == "cpu" and _jaxlib_version() < (0, 12):
            _warn_hierarchical_wrong_results()
    return algorithm


def _jaxlib_version() -> tuple[int, ...]:
    import jaxlib

    return tuple(int(p) for p in jaxlib.__version__.split(".")[:2])


@functools.cache
def _warn_hierarchical_wrong_results() -> None:
    warnings.warn(
        "algorithm='hierarchical' with backend='xla' across processes on CPU: with jaxlib "
        "0.10.2 the psum_scatter, psum and all_gather it runs (plain JAX, gloo) sometimes "
        "return a block of wrong values; none were seen with jaxlib 0.12. Use 'auto' or "
        "'ring' here, or a newer jaxlib (docs/faults.md).",
        UserWarning,
        stacklevel=4,
    )
