"""CUDA kernel and allreduce benchmark: jaxcomm's GPU kernels against the
card's device-to-device copy bandwidth, and the FFI allreduce against
``lax.psum``.

Needs a CUDA GPU and jaxcomm built with its CUDA module (``jaxcomm._ffi_cuda``).

Kernels (one GPU, ``--size`` bytes of float32 input, default 256 MiB):

  copy          cudaMemcpyAsync device to device (the ``jaxcomm_cast`` handler
                with equal dtypes and scale 1): the reference bandwidth
  xla_scale     ``jax.jit(lambda x: x * 2)``: XLA's own elementwise fusion
  cast_bf16     float32 -> bfloat16 with a prescale (the wire cast)
  cast_f16      float32 -> float16 with a prescale
  pack_all      pack every chunk (32768-element chunks)
  pack_half     pack every other chunk (and zero the rest of the output)
  unpack_half   copy x, overwrite every other chunk from the packed buffer
  norms_f32     per-chunk L1 norms of float32
  norms_bf16    per-chunk L1 norms of bfloat16

Bandwidth = bytes the kernel must read plus write, over the median time of
one call (``jaxcomm.costmodel.time_rounds`` over samples of ``BATCH`` calls
dispatched back to back and waited for together, so the host round trip of
each call is not counted; two warm-up samples after the checked call);
``ratio`` = bandwidth / copy bandwidth (target: at least 0.8).
Every kernel's output is checked against NumPy on the same buffers it is
timed on; a mismatch exits with status 1.

Allreduce (all GPUs of the process, ``--size`` bytes per GPU, float32 sum):

  ffi_direct    the ffi handler with algorithm "direct" (ncclAllReduce)
  ffi_ring      the ffi handler's ring (ncclSend/ncclRecv, float32 adds)
  ffi_ring_bf16 the ring with a bfloat16 wire
  psum          ``lax.psum``

busbw = algbw * 2(N-1)/N (nccl-tests). Needs two GPUs or more: on one,
``jaxcomm.allreduce`` has no peer and returns its input without a call, so
the section is left out (the handler's one-rank path is in tests/test_cuda.py).

Usage: python bench/kernels.py [--size 256M] [--reps 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import bus_factor_allreduce, format_size, parse_size
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.costmodel import time_rounds

CHUNK = 32768


# Calls dispatched back to back inside one timed sample. A GPU kernel of a
# few hundred microseconds is otherwise timed with a host round trip of
# 20-30 us each (launch, then wait), which moved the ratios by up to 0.2
# between runs. Nothing here is a CPU collective, so several in flight is safe.
BATCH = 10


def _time(fn, args, reps: int) -> float:
    """Median seconds of one call over `reps` samples of BATCH calls each,
    after two warm-up samples (the call that was checked compiled it)."""

    def batch():
        return [fn(*args) for _ in range(BATCH)]

    (samples,) = time_rounds([batch], reps=reps, warmup=2)
    return statistics.median(samples) / BATCH


def _register_kernels() -> None:
    """jaxcomm registers only its collectives; the kernel handlers timed here
    come from the CUDA module's testing_registrations()."""
    from jaxcomm import _ffi_cuda

    for name, capsule in _ffi_cuda.testing_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def _ffi_kernel(name, out, **attrs):
    return jax.jit(lambda *a: jax.ffi.ffi_call(name, out)(*a, **attrs))


def _check(name: str, got, expected, exact: bool = True) -> None:
    got = np.asarray(got)
    ok = (
        np.array_equal(got.view(np.uint8), np.asarray(expected).view(np.uint8))
        if exact
        else np.allclose(got, expected, rtol=1e-4, atol=1e-2)
    )
    if not ok:
        print(f"FAILED: {name} does not match NumPy", file=sys.stderr)
        sys.exit(1)


def bench_kernels(size: int, reps: int) -> list[dict]:
    _register_kernels()
    n = size // 4
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal(n).astype(np.float32)
    x = jnp.asarray(x_np)
    xb_np = x_np.astype(jnp.bfloat16)
    xb = jnp.asarray(xb_np)
    nchunks = -(-n // CHUNK)
    all_mask = np.ones(nchunks, bool)
    half_mask = np.arange(nchunks) % 2 == 0
    sel_half = int(np.repeat(half_mask, CHUNK)[:n].sum())
    f32 = jax.ShapeDtypeStruct((n,), jnp.float32)

    def packed_ref(mask):
        sel = np.repeat(mask, CHUNK)[:n]
        return np.concatenate([x_np[sel], np.zeros(n - sel.sum(), np.float32)])

    def norms_ref(v):
        padded = np.zeros(nchunks * CHUNK, np.float64)
        padded[:n] = np.abs(np.asarray(v, np.float64))
        return padded.reshape(nchunks, CHUNK).sum(1)

    norms_out = jax.ShapeDtypeStruct((nchunks,), jnp.float32)
    scale = np.float64(0.5)
    cases = [
        # name, fn, args, bytes read + written, reference, exact
        (
            "copy",
            _ffi_kernel("jaxcomm_cast", f32, scale=np.float64(1)),
            (x,),
            8 * n,
            x_np,
            True,
        ),
        ("xla_scale", jax.jit(lambda v: v * 2), (x,), 8 * n, x_np * 2, True),
        (
            "cast_bf16",
            _ffi_kernel("jaxcomm_cast", jax.ShapeDtypeStruct((n,), jnp.bfloat16), scale=scale),
            (x,),
            6 * n,
            (x_np * np.float32(0.5)).astype(jnp.bfloat16),
            True,
        ),
        (
            "cast_f16",
            _ffi_kernel("jaxcomm_cast", jax.ShapeDtypeStruct((n,), jnp.float16), scale=scale),
            (x,),
            6 * n,
            (x_np * np.float32(0.5)).astype(np.float16),
            True,
        ),
        (
            "pack_all",
            _ffi_kernel("jaxcomm_pack_chunks", f32, chunk_size=np.int64(CHUNK)),
            (x, jnp.asarray(all_mask)),
            8 * n,
            packed_ref(all_mask),
            True,
        ),
        (
            "pack_half",
            _ffi_kernel("jaxcomm_pack_chunks", f32, chunk_size=np.int64(CHUNK)),
            (x, jnp.asarray(half_mask)),
            4 * n + 4 * sel_half,  # read + write the selected, zero the tail
            packed_ref(half_mask),
            True,
        ),
        (
            "unpack_half",
            _ffi_kernel("jaxcomm_unpack_chunks", f32, chunk_size=np.int64(CHUNK)),
            (x, x, jnp.asarray(half_mask)),
            8 * n + 8 * sel_half,  # copy x, then read packed and write the selected
            None,
            True,
        ),
        (
            "norms_f32",
            _ffi_kernel("jaxcomm_chunk_norms", norms_out, chunk_size=np.int64(CHUNK)),
            (x,),
            4 * n,
            norms_ref(x_np),
            False,
        ),
        (
            "norms_bf16",
            _ffi_kernel("jaxcomm_chunk_norms", norms_out, chunk_size=np.int64(CHUNK)),
            (xb,),
            2 * n,
            norms_ref(xb_np.astype(np.float32)),
            False,
        ),
    ]
    rows = []
    copy_bw = None
    for name, fn, args, nbytes, ref, exact in cases:
        out = fn(*args)
        if name == "unpack_half":
            # packed == x: selected chunk c takes packed[offset(c)], i.e. an
            # earlier chunk of x; check against that mapping.
            sel = np.flatnonzero(half_mask)
            ref = x_np.copy()
            for k, c in enumerate(sel):
                length = min(CHUNK, n - c * CHUNK)
                ref[c * CHUNK : c * CHUNK + length] = x_np[k * CHUNK : k * CHUNK + length]
        _check(name, out, ref, exact)
        seconds = _time(fn, args, reps)
        bw = nbytes / seconds / 1e9
        copy_bw = bw if name == "copy" else copy_bw
        rows.append(
            {
                "kernel": name,
                "bytes": nbytes,
                "us": seconds * 1e6,
                "GBps": bw,
                "ratio_to_copy": bw / copy_bw,
            }
        )
    return rows


def bench_allreduce(size: int, reps: int) -> list[dict]:
    gpus = jax.devices("gpu")
    N = len(gpus)
    mesh = jax.make_mesh((N,), ("x",), devices=gpus)
    spec = P("x")
    count = size // 4
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((N, count)).astype(np.float32)
    x = jax.device_put(xs.reshape(-1), NamedSharding(mesh, spec))
    expected = xs.astype(np.float64).sum(0)

    def ffi(algorithm, wire):
        def body(v):
            return jaxcomm.allreduce(v, "x", algorithm=algorithm, wire_dtype=wire, backend="ffi")

        return body

    impls = [
        ("ffi_direct", ffi("direct", np.dtype(np.float32)), 1e-5),
        ("ffi_ring", ffi("ring", np.dtype(np.float32)), 1e-5),
        ("ffi_ring_bf16", ffi("ring", np.dtype(jnp.bfloat16)), 3e-2),
        ("psum", lambda v: jax.lax.psum(v, "x"), 1e-5),
    ]
    rows = []
    results = {}
    for name, body, tol in impls:
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        out = np.asarray(fn(x)).reshape(N, count)
        for row in out:
            if not np.allclose(row, expected, rtol=tol, atol=tol * N * 4):
                print(f"FAILED: {name} allreduce does not match NumPy", file=sys.stderr)
                sys.exit(1)
        results[name] = _time(fn, (x,), reps)
    psum_us = results["psum"] * 1e6
    for name, seconds in results.items():
        algbw = size / seconds / 1e9
        rows.append(
            {
                "impl": name,
                "gpus": N,
                "bytes_per_gpu": size,
                "us": seconds * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * bus_factor_allreduce(N),
                "time_vs_psum": seconds * 1e6 / psum_us,
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256M", help="bytes per buffer (per GPU), e.g. 64M")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus or not jaxcomm.ffi_available("gpu"):
        print("needs a CUDA GPU and jaxcomm built with its CUDA module", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    kernels = bench_kernels(size, args.reps)
    # With one GPU jaxcomm.allreduce returns its input without a call (no
    # peer, nothing to send), so only several GPUs have an allreduce to time.
    allreduce = bench_allreduce(size, args.reps) if len(gpus) > 1 else []
    report = {
        "device": gpus[0].device_kind,
        "gpus": len(gpus),
        "size": size,
        "kernels": kernels,
        "allreduce": allreduce,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']} x{len(gpus)}, {format_size(size)} per buffer")
    print(f"{'kernel':<14}{'us':>10}{'GB/s':>10}{'ratio':>8}")
    for r in kernels:
        print(f"{r['kernel']:<14}{r['us']:>10.1f}{r['GBps']:>10.1f}{r['ratio_to_copy']:>8.2f}")
    print(f"{'allreduce':<14}{'us':>10}{'algbw':>10}{'busbw':>10}{'vs psum':>9}")
    for r in allreduce:
        print(
            f"{r['impl']:<14}{r['us']:>10.1f}{r['algbw_GBps']:>10.1f}"
            f"{r['busbw_GBps']:>10.1f}{r['time_vs_psum']:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
