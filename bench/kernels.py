"""CUDA kernel and allreduce benchmark: jaxcomm's GPU kernels against XLA's
own fusion of the same work and the card's device-to-device copy bandwidth,
and the FFI allreduce against ``lax.psum``.

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

Every kernel but copy and xla_scale has an XLA twin in ``XLA_TWINS``: the same
work in plain ``jax.numpy`` (same inputs, same output values and dtype), timed
under ``jax.jit`` in the same rounds as the kernel. Where a twin is as fast
as its kernel, the twin is the one to use.

Bandwidth = bytes the kernel must read plus write, over the median time of
one call (``jaxcomm.costmodel.time_rounds`` over samples of ``BATCH`` calls
dispatched back to back and waited for together, so the host round trip of
each call is not counted; two warm-up samples after the checked call). The
twin is credited with the kernel's bytes, so ``vs_xla`` = kernel bandwidth /
twin bandwidth = twin time / kernel time (target: at least 0.95; the JSON's
``kernels_below_xla_target`` lists the kernels under it). ``ratio`` =
bandwidth / copy bandwidth, for comparison with earlier runs.
Every kernel's and twin's output is checked against NumPy on the same buffers
it is timed on; a mismatch exits with status 1.

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
import functools
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


# Target for every kernel's bandwidth over its XLA twin's.
VS_XLA_TARGET = 0.95


# XLA twins: each kernel's work in plain jax.numpy, taking the kernel's
# arguments and its FFI attributes as keywords, and returning what the kernel
# returns (values and dtype). tests/test_kernels_bench.py checks them on CPU.


def _rows(v, nchunks: int, chunk_size: int):
    """v zero-padded to whole chunks, one chunk a row. Only the last chunk can
    be short; its padding adds nothing to a norm, and what pack and unpack
    move of it lands among the packed zeros or past [:n]."""
    return jnp.pad(v, (0, nchunks * chunk_size - v.shape[0])).reshape(nchunks, chunk_size)


def xla_cast(x, *, dtype, scale):
    """dtype(x * scale), the product in float32 (float64 if either side is)
    and then cast, rounding to nearest even: the kernel's two roundings."""
    wide = jnp.promote_types(jnp.promote_types(x.dtype, dtype), jnp.float32)
    return (x.astype(wide) * jnp.asarray(scale, wide)).astype(dtype)


def xla_pack(x, mask, *, chunk_size):
    """The selected chunks of x in order at the front, zeros after them."""
    n, nchunks, chunk_size = x.shape[0], mask.shape[0], int(chunk_size)
    order = jnp.argsort(~mask, stable=True)  # selected chunks first, in order
    rows = _rows(x, nchunks, chunk_size).at[order]
    rows = rows.get(mode="promise_in_bounds", unique_indices=True)
    kept = jnp.arange(nchunks) < jnp.sum(mask)
    # A selected short last chunk is packed last, so its padding lands where
    # the zeros start and [:n] keeps the packed data dense.
    return jnp.where(kept[:, None], rows, 0).reshape(-1)[:n]


def xla_unpack(packed, x, mask, *, chunk_size):
    """x, except selected chunk c = the chunk at c's packed position."""
    n, nchunks, chunk_size = x.shape[0], mask.shape[0], int(chunk_size)
    position = jnp.cumsum(mask, dtype=jnp.int32) - mask  # selected chunks before c
    from_packed = _rows(packed, nchunks, chunk_size).at[position].get(mode="promise_in_bounds")
    rows = jnp.where(mask[:, None], from_packed, _rows(x, nchunks, chunk_size))
    return rows.reshape(-1)[:n]


def xla_norms(x, *, chunk_size):
    """float32 sum of |x| over each chunk; a short last chunk sums what it has."""
    chunk_size = int(chunk_size)
    nchunks = -(-x.shape[0] // chunk_size)
    return jnp.abs(_rows(x.astype(jnp.float32), nchunks, chunk_size)).sum(axis=1)


XLA_TWINS = {
    "cast_bf16": functools.partial(xla_cast, dtype=jnp.bfloat16),
    "cast_f16": functools.partial(xla_cast, dtype=jnp.float16),
    "pack_all": xla_pack,
    "pack_half": xla_pack,
    "unpack_half": xla_unpack,
    "norms_f32": xla_norms,
    "norms_bf16": xla_norms,
}


def _time(calls, reps: int) -> list[float]:
    """Median seconds of one call of each (fn, args) in `calls`, over `reps`
    samples of BATCH calls each, the calls' samples interleaved (time_rounds
    rotates their order each round, so a drift in clocks touches all alike),
    after two warm-up samples (the call that was checked compiled it)."""

    def batch(fn, args):
        return lambda: [fn(*args) for _ in range(BATCH)]

    samples = time_rounds([batch(fn, args) for fn, args in calls], reps=reps, warmup=2)
    return [statistics.median(s) / BATCH for s in samples]


def below_xla_target(rows: list[dict]) -> list[str]:
    """The kernels whose bandwidth is under VS_XLA_TARGET of their twin's."""
    return [r["kernel"] for r in rows if r["vs_xla"] is not None and r["vs_xla"] < VS_XLA_TARGET]


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

    def unpacked_ref(mask):
        # packed == x: selected chunk c takes packed[offset(c)], i.e. an
        # earlier chunk of x; check against that mapping.
        ref = x_np.copy()
        for k, c in enumerate(np.flatnonzero(mask)):
            length = min(CHUNK, n - c * CHUNK)
            ref[c * CHUNK : c * CHUNK + length] = x_np[k * CHUNK : k * CHUNK + length]
        return ref

    def norms_ref(v):
        padded = np.zeros(nchunks * CHUNK, np.float64)
        padded[:n] = np.abs(np.asarray(v, np.float64))
        return padded.reshape(nchunks, CHUNK).sum(1)

    norms_out = jax.ShapeDtypeStruct((nchunks,), jnp.float32)
    # The FFI attributes, passed alike to a kernel and its XLA twin.
    cast = {"scale": np.float64(0.5)}
    chunks = {"chunk_size": np.int64(CHUNK)}
    cases = [
        # name, fn, args, attributes, bytes read + written, reference, exact
        (
            "copy",
            _ffi_kernel("jaxcomm_cast", f32, scale=np.float64(1)),
            (x,),
            {},
            8 * n,
            x_np,
            True,
        ),
        ("xla_scale", jax.jit(lambda v: v * 2), (x,), {}, 8 * n, x_np * 2, True),
        (
            "cast_bf16",
            _ffi_kernel("jaxcomm_cast", jax.ShapeDtypeStruct((n,), jnp.bfloat16), **cast),
            (x,),
            cast,
            6 * n,
            (x_np * np.float32(0.5)).astype(jnp.bfloat16),
            True,
        ),
        (
            "cast_f16",
            _ffi_kernel("jaxcomm_cast", jax.ShapeDtypeStruct((n,), jnp.float16), **cast),
            (x,),
            cast,
            6 * n,
            (x_np * np.float32(0.5)).astype(np.float16),
            True,
        ),
        (
            "pack_all",
            _ffi_kernel("jaxcomm_pack_chunks", f32, **chunks),
            (x, jnp.asarray(all_mask)),
            chunks,
            8 * n,
            packed_ref(all_mask),
            True,
        ),
        (
            "pack_half",
            _ffi_kernel("jaxcomm_pack_chunks", f32, **chunks),
            (x, jnp.asarray(half_mask)),
            chunks,
            4 * n + 4 * sel_half,  # read + write the selected, zero the tail
            packed_ref(half_mask),
            True,
        ),
        (
            "unpack_half",
            _ffi_kernel("jaxcomm_unpack_chunks", f32, **chunks),
            (x, x, jnp.asarray(half_mask)),
            chunks,
            8 * n + 8 * sel_half,  # copy x, then read packed and write the selected
            unpacked_ref(half_mask),
            True,
        ),
        (
            "norms_f32",
            _ffi_kernel("jaxcomm_chunk_norms", norms_out, **chunks),
            (x,),
            chunks,
            4 * n,
            norms_ref(x_np),
            False,
        ),
        (
            "norms_bf16",
            _ffi_kernel("jaxcomm_chunk_norms", norms_out, **chunks),
            (xb,),
            chunks,
            2 * n,
            norms_ref(xb_np.astype(np.float32)),
            False,
        ),
    ]
    rows = []
    copy_bw = None
    for name, fn, args, attrs, nbytes, ref, exact in cases:
        out = fn(*args)
        _check(name, out, ref, exact)
        calls = [(fn, args)]
        if name in XLA_TWINS:
            twin = jax.jit(functools.partial(XLA_TWINS[name], **attrs))
            twin_out = twin(*args)
            if (twin_out.shape, twin_out.dtype) != (out.shape, out.dtype):
                print(f"FAILED: {name}'s XLA twin returns another shape or dtype", file=sys.stderr)
                sys.exit(1)
            _check(f"{name}'s XLA twin", twin_out, ref, exact)
            calls.append((twin, args))
        # Kernel and twin in the same rounds: their ratio is what is judged.
        seconds, *twin_seconds = _time(calls, reps)
        bw = nbytes / seconds / 1e9
        copy_bw = bw if name == "copy" else copy_bw
        # The twin is credited with the kernel's bytes: the same work.
        xla_bw = nbytes / twin_seconds[0] / 1e9 if twin_seconds else None
        rows.append(
            {
                "kernel": name,
                "bytes": nbytes,
                "us": seconds * 1e6,
                "GBps": bw,
                "ratio_to_copy": bw / copy_bw,
                "xla_us": twin_seconds[0] * 1e6 if twin_seconds else None,
                "xla_bandwidth_GBps": xla_bw,
                "vs_xla": bw / xla_bw if xla_bw else None,
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
        (results[name],) = _time([(fn, (x,))], reps)
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


def kernel_table(rows: list[dict]) -> list[str]:
    """The kernels' rows as printed: ``ratio`` against copy, then the XLA
    twin's time and bandwidth and ``vs xla`` (``-`` for rows without a twin)."""
    lines = [
        f"{'kernel':<14}{'us':>10}{'GB/s':>10}{'ratio':>8}{'xla us':>10}{'xla GB/s':>10}"
        f"{'vs xla':>8}"
    ]
    for r in rows:
        line = f"{r['kernel']:<14}{r['us']:>10.1f}{r['GBps']:>10.1f}{r['ratio_to_copy']:>8.2f}"
        if r["vs_xla"] is None:
            line += f"{'-':>10}{'-':>10}{'-':>8}"
        else:
            line += f"{r['xla_us']:>10.1f}{r['xla_bandwidth_GBps']:>10.1f}{r['vs_xla']:>8.2f}"
        lines.append(line)
    return lines


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
        "vs_xla_target": VS_XLA_TARGET,
        "kernels_below_xla_target": below_xla_target(kernels),
        "allreduce": allreduce,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']} x{len(gpus)}, {format_size(size)} per buffer")
    print("\n".join(kernel_table(kernels)))
    below = report["kernels_below_xla_target"]
    print(f"under {VS_XLA_TARGET} of XLA: {', '.join(below) if below else 'none'}")
    print(f"{'allreduce':<14}{'us':>10}{'algbw':>10}{'busbw':>10}{'vs psum':>9}")
    for r in allreduce:
        print(
            f"{r['impl']:<14}{r['us']:>10.1f}{r['algbw_GBps']:>10.1f}"
            f"{r['busbw_GBps']:>10.1f}{r['time_vs_psum']:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
