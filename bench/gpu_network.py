"""The GPU allreduce table over a slow network, on one GPU: N processes
(``python -m jaxcomm.launch``) share the GPU, each its own "host" to NCCL
(NCCL_HOSTID) with NCCL's peer-to-peer and shared-memory transports off, so
every byte goes over TCP sockets on loopback, as between machines.

For each process count: 64 MiB of float32 per rank (``--mib``), each path
timed ``--repeats`` times (median; 2 warm-up calls first), and reported
relative to ``lax.psum`` of float32 measured in the same run:

  lax.psum f32 / bf16         XLA's all-reduce (NCCL's ring; bf16 adds in bf16)
  xla ring bf16               jaxcomm's ring over ppermute, float32 adds
  ffi direct f32              the CUDA handler's ncclAllReduce
  ffi ring f32 / bf16         the handler's ring: 2(N-1) send/recv groups
  ffi alltoall f32/bf16/f16   one grouped all-to-all, float32 adds, one all-gather
  ffi auto bf16               what algorithm="auto" runs for a bf16 wire
  ffi masked f32 / bf16       chunk-sparse: 15% of the chunks (``--density``)

  python bench/gpu_network.py [--processes 2,4] [--mib 64] [--repeats 7] [--json PATH]

Prints the table and one JSON object (``{"rows": [...]}``) as its last line;
``--json`` writes the rows to a file too. Needs a GPU and jaxcomm's CUDA module.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

NCCL_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}
CHUNK = 32 * 1024  # elements per chunk of the masked paths


def _paths(density):
    """(name, backend-or-psum, options) for every row, psum f32 first."""
    masked = {"chunk_size": CHUNK, "density": density, "unselected": "zero"}
    return [
        ("lax.psum f32", "psum", {}),
        ("lax.psum bf16", "psum", {"cast": "bfloat16"}),
        ("xla ring bf16", "xla", {"algorithm": "ring", "wire_dtype": "bfloat16"}),
        ("ffi direct f32", "ffi", {"algorithm": "direct"}),
        ("ffi ring f32", "ffi", {"algorithm": "ring"}),
        ("ffi ring bf16", "ffi", {"algorithm": "ring", "wire_dtype": "bfloat16"}),
        ("ffi alltoall f32", "ffi", {"algorithm": "alltoall"}),
        ("ffi alltoall bf16", "ffi", {"algorithm": "alltoall", "wire_dtype": "bfloat16"}),
        ("ffi alltoall f16", "ffi", {"algorithm": "alltoall", "wire_dtype": "float16"}),
        ("ffi auto bf16", "ffi", {"algorithm": "auto", "wire_dtype": "bfloat16"}),
        (f"ffi masked f32 d={density}", "ffi", {"algorithm": "auto", **masked}),
        (
            f"ffi masked bf16 d={density}",
            "ffi",
            {"algorithm": "auto", "wire_dtype": "bfloat16", **masked},
        ),
    ]


def worker(args):
    """One process of the job: times every path, rank 0 writes the rows."""
    os.environ["NCCL_HOSTID"] = "jaxcomm-host-" + os.environ["JAXCOMM_PROCESS_ID"]
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm import distributed

    distributed.initialize()
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    elems = args.mib * (1 << 20) // 4
    sharding = NamedSharding(mesh, P("d"))
    local = np.random.default_rng(jax.process_index()).standard_normal((1, elems), np.float32)
    x = jax.make_array_from_single_device_arrays(
        (n, elems), sharding, [jax.device_put(local, jax.local_devices()[0])]
    )
    rows = []
    base = None
    for name, backend, options in _paths(args.density):
        options = dict(options)

        if backend == "psum":
            cast = options.get("cast")

            def body(v, cast=cast):
                w = v if cast is None else v.astype(cast)
                return jax.lax.psum(w, "d").astype(v.dtype)

        else:
            extra = {}
            if "density" in options:
                nchunks = -(-elems // CHUNK)
                keep = max(1, round(options.pop("density") * nchunks))
                mask = np.zeros(nchunks, bool)
                mask[np.random.default_rng(0).choice(nchunks, keep, replace=False)] = True
                extra = {"chunk_mask": jnp.asarray(mask), "max_chunks": keep}

            def body(v, options=options, extra=extra, backend=backend):
                return jaxcomm.allreduce(v, "d", backend=backend, **options, **extra)

        f = jax.jit(
            jax.shard_map(lambda v, body=body: body(v[0])[None], mesh=mesh, in_specs=P("d"),
                          out_specs=P("d"))
        )  # fmt: skip
        try:
            for _ in range(2):
                f(x).block_until_ready()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                f(x).block_until_ready()
                times.append(time.perf_counter() - start)
            seconds = float(np.median(times))
            error = None
        except Exception as e:  # a path that fails is reported, the others still run
            seconds, error = None, f"{type(e).__name__}: {str(e)[:300]}"
        if base is None:
            base = seconds
        rows.append(
            {
                "processes": n,
                "path": name,
                "mib_per_rank": args.mib,
                "median_s": seconds,
                "relative_to_psum_f32": None if seconds is None or not base else seconds / base,
                "repeats": args.repeats,
                "error": error,
            }
        )
    if jax.process_index() == 0:
        with open(args.out, "w") as fh:
            json.dump(rows, fh)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", default="2,4")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--density", type=float, default=0.15)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--timeout", type=float, default=300, help="seconds per process count")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    env = {**os.environ, **NCCL_ENV}
    env.pop("XLA_FLAGS", None)
    rows = []
    for count in [int(c) for c in args.processes.split(",") if c.strip()]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [
                sys.executable, "-m", "jaxcomm.launch", "-n", str(count), os.path.abspath(__file__),
                "--worker", "--mib", str(args.mib), "--repeats", str(args.repeats),
                "--density", str(args.density), "--out", out,
            ]  # fmt: skip
            try:
                run = subprocess.run(cmd, env=env, timeout=args.timeout, text=True,
                                     capture_output=True)  # fmt: skip
                failed = run.returncode != 0 or not os.path.exists(out)
                why = (run.stdout + run.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                failed, why = True, f"timed out after {args.timeout} s"
            if failed:
                print(f"{count} processes failed:\n{why}", file=sys.stderr)
                rows.append({"processes": count, "error": why[-500:]})
                continue
            with open(out) as fh:
                rows.extend(json.load(fh))

    print(f"{'processes':>9}  {'path':<26} {'median ms':>10} {'x psum f32':>10}")
    for r in rows:
        if "path" not in r:
            print(f"{r['processes']:>9}  failed: {r['error'][-200:]}")
            continue
        ms = "-" if r["median_s"] is None else f"{r['median_s'] * 1e3:.1f}"
        rel = r["relative_to_psum_f32"]
        print(
            f"{r['processes']:>9}  {r['path']:<26} {ms:>10} "
            f"{'-' if rel is None else f'{rel:.2f}':>10}{'  ' + r['error'] if r['error'] else ''}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    print(json.dumps({"rows": rows}))
    return 1 if any("path" not in r or r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
