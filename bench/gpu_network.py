"""GPU processes on a slow network, on one GPU: N processes (``python -m
jaxcomm.launch --one-gpu-each``) share the GPU (or take one each where there
are N), each its own "host" to NCCL (NCCL_HOSTID)
with NCCL's peer-to-peer and shared-memory transports off, so every byte
goes over TCP sockets on loopback, as between machines. Three tables:

``allreduce`` -- 64 MiB of float32 per rank (``--mib``), each path timed
``--repeats`` times (median; 2 warm-up calls first), relative to
``lax.psum`` of float32 measured in the same run:

  lax.psum f32 / bf16         XLA's all-reduce (NCCL's ring; bf16 adds in bf16)
  xla ring bf16               jaxcomm's ring over ppermute, float32 adds
  ffi direct f32              the CUDA handler's ncclAllReduce
  ffi ring f32 / bf16         the handler's ring: 2(N-1) send/recv groups
  ffi alltoall f32/bf16/f16   one grouped all-to-all, float32 adds, one all-gather
  ffi auto bf16               what algorithm="auto" runs for a bf16 wire
  ffi masked f32 / bf16       chunk-sparse: 15% of the chunks (``--density``)

``train`` -- a training step per gradient-exchange configuration
(``--configs``, bench/network_worker.py's names) for each model
(``--models``): the 25M-parameter MLP (2048 -> 4096 -> 4096 -> 10, 64
examples per rank) and examples/lm's byte transformer; the mean step time
over ``--steps`` steps (one in flight) and the speed-up over ``dense``, the
hand-written ``lax.pmean`` step.

``overlap`` -- does XLA run double buffering's collective under the
backward pass? The MLP at a batch sized so that its compute alone takes
about as long as a ``lax.psum`` of its gradient (on the line through two
probe batches, ``--batch-per-device`` and ``PROBE_FACTOR`` times it), then:
compute alone, the collective alone, the dense step, the double-buffered
steps (``double_buffering``, ``dga``) and Streaming DiLoCo's, under XLA's
default flags and with its latency-hiding scheduler (``XLA_SETTINGS``).
Each row also counts, from the compiled program, the compute XLA scheduled
between each asynchronous collective's start and done.

Targets (``TARGETS``, each process count's best path): a 16-bit ffi wire at
most 0.55 of ``lax.psum`` float32, ffi float32 at most 1.05, the masked
exchange at density 0.15 at most 0.3; the double-buffered step at most 1.15
x max(compute, collective).

  python bench/gpu_network.py [--tables allreduce,train,overlap] [--processes 2,4]
      [--mib 64] [--repeats 7] [--configs ...] [--models mlp,lm] [--steps 6]
      [--overlap-processes 2] [--budget S] [--json PATH] [--plot PATH.png]

Prints the tables and, as its last line, one JSON object (``{"rows",
"overlap", "targets"}``), which ``--json`` also writes. Needs a GPU and
jaxcomm's CUDA module for the numbers to mean anything; on a machine
without a GPU the same processes run on CPU devices over gloo and TCP (the
tests use that to check the harness, not its speed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # network_worker, also when imported by the tests
import network_worker  # noqa: E402  (beside this file; no JAX at import)
from _common import pyplot  # noqa: E402

from jaxcomm import launch as launch_module  # noqa: E402  (its visible_gpus)

NCCL_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}
CHUNK = 32 * 1024  # elements per chunk of the masked paths
TABLES = ("allreduce", "train", "overlap")
# Every configuration of the training table against the pmean step: 16-bit
# wires on each path, chunk-sparse, PowerSGD, double buffering, no exchange.
TRAIN_CONFIGS = (
    "dense,allreduce,bf16,bf16_ring,bf16_ffi,allreduce_ffi,chunk_sparse,chunk_sparse_ffi,"
    "powersgd_r4,double_buffering,dga,compute"
)
OVERLAP_CONFIGS = "compute,dense,double_buffering,dga,streaming_diloco"
# The MLP of both tables (bench/network_worker.py's, 25.2M parameters).
FEATURES, HIDDEN, BATCH = 2048, 4096, 64
# The overlap table's second compute probe: this many times the first's
# batch, far enough apart that the line through them is not a small batch's
# launch costs.
PROBE_FACTOR = 16
# XLA's GPU flags the overlap table runs under.
XLA_SETTINGS = {
    "default": "",
    "latency_hiding": "--xla_gpu_enable_latency_hiding_scheduler=true",
}
# The overlap table's columns: each a key of the run's summary (``overlap_summary``).
OVERLAP_COLUMNS = {
    "compute": "compute_s",
    "psum": "collective_s",
    "dense": "dense_s",
    "db": "double_buffering_s",
    "dga": "dga_s",
    "streaming": "streaming_diloco_s",
}
TARGETS = {"narrow_wire": 0.55, "float32_wire": 1.05, "masked": 0.30, "double_buffered": 1.15}
ROW = re.compile(r"^\[rank 0\] @row (\{.*\})\s*$")


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


def allreduce_worker(args):
    """One process of the allreduce table: times every path; process 0 prints the rows."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    jaxcomm.distributed.initialize()
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    elems = args.mib * (1 << 20) // 4
    sharding = NamedSharding(mesh, P("d"))
    local = np.random.default_rng(jax.process_index()).standard_normal((1, elems), np.float32)
    x = jax.make_array_from_single_device_arrays(
        (n, elems), sharding, [jax.device_put(local, jax.local_devices()[0])]
    )
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
            jax.shard_map(
                lambda v, body=body: body(v[0])[None], mesh=mesh, in_specs=P("d"), out_specs=P("d")
            )
        )
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
        network_worker.emit(
            {
                "table": "allreduce",
                "processes": n,
                "path": name,
                "mib_per_rank": args.mib,
                "median_s": seconds,
                "relative_to_psum_f32": None if seconds is None or not base else seconds / base,
                "repeats": args.repeats,
                "error": error,
            }
        )


def fitted_batch(b0: int, t0: float, b1: int, t1: float, target: float, cap: int) -> int:
    """The batch whose compute takes ``target`` seconds on the line through
    (b0, t0) and (b1, t1), a multiple of 8 in [8, cap]; ``b1`` (so capped)
    where compute does not grow with the batch."""
    slope = (t1 - t0) / (b1 - b0)
    batch = b1 if slope <= 0 else b0 + (target - t0) / slope
    return int(min(cap, max(8, 8 * round(batch / 8))))


def overlap_worker(args):
    """One process of the overlap table: probes, sizes the batch, runs."""
    nw = network_worker

    import jaxcomm

    jaxcomm.distributed.initialize()
    common = ["--workload", "train", "--features", str(args.features)]
    common += ["--hidden", str(args.hidden), "--steps", str(args.steps)]
    b0, b1 = args.batch_per_device, PROBE_FACTOR * args.batch_per_device
    probes = [
        nw.run_train(nw.parse_args(common + ["--configs", "compute", "--batch-per-device", str(b)]))
        for b in (b0, b1)
    ]
    if any("step_s" not in p[0] for p in probes):
        raise RuntimeError(f"overlap: a compute probe failed: {probes}")
    mib = probes[0][0]["params"] * 4 / nw.MIB  # the float32 gradient
    (collective,) = nw.run_allreduce(
        nw.parse_args(
            ["--workload", "allreduce", "--paths", "auto", "--wires", "float32"]
            + ["--sizes-mib", repr(mib), "--repeats", str(args.repeats)]
        )
    )
    if "time_s" not in collective:
        raise RuntimeError(f"overlap: the collective alone failed: {collective}")
    batch = fitted_batch(
        b0,
        probes[0][0]["step_s"],
        b1,
        probes[1][0]["step_s"],
        collective["time_s"],
        args.max_batch,
    )
    nw.progress(f"overlap: {mib:.1f} MiB psum {collective['time_s']:.4f} s; batch {batch}")
    nw.run_train(
        nw.parse_args(
            common
            + ["--configs", args.overlap_configs, "--batch-per-device", str(batch)]
            + ["--hlo-overlap"]
        )
    )


def launch(count: int, argv: list[str], timeout: float, xla_flags: str = "") -> list[dict]:
    """Runs this file's worker in ``count`` processes; process 0's rows, or
    one row with ``error`` if the job failed."""
    env = {**os.environ, **NCCL_ENV}
    env.pop("XLA_FLAGS", None)  # a test session's 8 host devices
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    cmd = [sys.executable, "-m", "jaxcomm.launch", "-n", str(count)]
    # One GPU each (the same one on a one-GPU machine); none on a CPU-only one.
    cmd += ["--one-gpu-each"] if launch_module.visible_gpus(dict(os.environ)) else []
    cmd += [os.path.abspath(__file__)]
    try:
        run = subprocess.run(cmd + argv, env=env, timeout=timeout, text=True, capture_output=True)
        out, why = run.stdout, (run.stdout + run.stderr)[-2000:]
        failed = run.returncode != 0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        failed, why = True, f"timed out after {timeout} s"
    rows = [json.loads(m.group(1)) for m in map(ROW.match, out.splitlines()) if m]
    if failed:
        print(f"{count} processes, {argv[:2]}: failed\n{why}", file=sys.stderr)
        rows.append({"processes": count, "error": why[-500:]})
    return rows


def overlap_summary(rows: list[dict]) -> dict:
    """One overlap run's rows (the probes, marked ``probe``, the psum alone,
    then the configurations) as times, each step against max(compute,
    collective)."""
    by = {r.get("config"): r for r in rows if "step_s" in r and not r.get("probe")}
    collective = next((r["time_s"] for r in rows if "time_s" in r), None)
    s = {"collective_s": collective}
    for config, r in by.items():
        s[f"{config}_s"] = r["mean_step_s"]
        s.setdefault("batch_per_device", r.get("batch_per_device"))
        if "compute_under_collectives" in r:
            s[f"{config}_compute_under_collectives"] = r["compute_under_collectives"]
    if collective and "compute" in by:
        bound = max(by["compute"]["mean_step_s"], collective)
        s["bound_s"] = bound
        s["compute_over_collective"] = by["compute"]["mean_step_s"] / collective
        for config in ("dense", "double_buffering", "dga", "streaming_diloco"):
            if config in by:
                s[f"{config}_over_bound"] = by[config]["mean_step_s"] / bound
    return s


def targets(rows: list[dict], overlaps: list[dict]) -> list[dict]:
    """Each target of ``TARGETS`` per process count (and XLA setting): the
    best measured value, the limit, and whether it is met."""
    out = []

    def add(name, where, candidates):
        values = [(v, path) for v, path in candidates if v is not None]
        if values:
            value, path = min(values)
            limit = TARGETS[name]
            out.append(
                {
                    "target": name,
                    **where,
                    "path": path,
                    "value": value,
                    "limit": limit,
                    "met": value <= limit,
                }
            )

    allreduce = [r for r in rows if r.get("table") == "allreduce" and "path" in r]
    for n in sorted({r["processes"] for r in allreduce}):
        mine = [(r["relative_to_psum_f32"], r["path"]) for r in allreduce if r["processes"] == n]
        ffi = [(v, p) for v, p in mine if p.startswith("ffi") and "masked" not in p]
        add("narrow_wire", {"processes": n}, [(v, p) for v, p in ffi if "16" in p])
        add("float32_wire", {"processes": n}, [(v, p) for v, p in ffi if "f32" in p])
        add("masked", {"processes": n}, [(v, p) for v, p in mine if "masked" in p])
    for s in overlaps:
        where = {"processes": s["processes"], "xla": s["xla"]}
        add(
            "double_buffered",
            where,
            [(s.get(f"{c}_over_bound"), c) for c in ("double_buffering", "dga")],
        )
    return out


def print_tables(rows: list[dict], overlaps: list[dict], checks: list[dict]) -> None:
    allreduce = [r for r in rows if r.get("table") == "allreduce"]
    if allreduce:
        print(f"{'processes':>9}  {'path':<26} {'median ms':>10} {'x psum f32':>10}")
    for r in allreduce:
        if "path" not in r:  # the job failed or was skipped
            print(f"{r['processes']:>9}  {r.get('error', '')[-200:]}")
            continue
        ms = "-" if r.get("median_s") is None else f"{r['median_s'] * 1e3:.1f}"
        rel = r.get("relative_to_psum_f32")
        print(
            f"{r['processes']:>9}  {r['path']:<26} {ms:>10} "
            f"{'-' if rel is None else f'{rel:.2f}':>10}{'  ' + r['error'] if r['error'] else ''}"
        )
    train = [r for r in rows if r.get("table") == "train"]
    if train:
        print(f"\n{'processes':>9}  {'model':<6}{'config':<19}{'step ms':>9}{'speed-up':>10}")
    for r in train:
        if "mean_step_s" not in r:
            print(
                f"{r['processes']:>9}  {r.get('model', ''):<6}{r.get('config', ''):<19}  "
                f"{r.get('error', '')[-200:]}"
            )
            continue
        up = r.get("speedup_vs_dense")
        print(
            f"{r['processes']:>9}  {r['model']:<6}{r['config']:<19}{r['mean_step_s'] * 1e3:>9.1f}"
            f"{'-' if up is None else f'{up:.2f}x':>10}"
        )
    if overlaps:
        print(
            f"\n{'processes':>9}  {'XLA':<15}{'batch':>6}"
            + "".join(f"{c:>11}" for c in OVERLAP_COLUMNS)
            + f"{'db / max':>10}{'dga / max':>10}"
        )
    for s in overlaps:
        ms = [s.get(k) for k in OVERLAP_COLUMNS.values()]
        ratios = [s.get(k) for k in ("double_buffering_over_bound", "dga_over_bound")]
        print(
            f"{s['processes']:>9}  {s['xla']:<15}{s.get('batch_per_device') or '-':>6}"
            + "".join("          -" if v is None else f"{v * 1e3:>9.1f}ms" for v in ms)
            + "".join("         -" if v is None else f"{v:>10.2f}" for v in ratios)
        )
    for c in checks:
        where = f"{c['processes']} processes" + (f", XLA {c['xla']}" if "xla" in c else "")
        print(
            f"target {c['target']:<16}{where:<34}{c['value']:.2f} (limit {c['limit']}, "
            f"{c['path']}): {'met' if c['met'] else 'MISSED'}"
        )


def plot(rows: list[dict], overlaps: list[dict], path: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(18, 6))
    panels = [
        (
            axes[0],
            "allreduce",
            "path",
            "relative_to_psum_f32",
            "time / lax.psum f32 (lower is better)",
        ),
        (axes[1], "train", "config", "speedup_vs_dense", "speed-up over the pmean step (MLP)"),
    ]
    for ax, table, key, value, title in panels:
        mine = [r for r in rows if r.get("table") == table and r.get(value) is not None]
        mine = [r for r in mine if r.get("model", "mlp") == "mlp"]
        counts = sorted({r["processes"] for r in mine})
        names = list(dict.fromkeys(r[key] for r in mine))
        width = 0.8 / max(1, len(counts))
        for i, n in enumerate(counts):
            got = {r[key]: r[value] for r in mine if r["processes"] == n}
            ax.barh(
                [j + i * width for j in range(len(names))],
                [got.get(name, 0) for name in names],
                width,
                label=f"{n} processes",
            )
        ax.set_yticks([j + width * (len(counts) - 1) / 2 for j in range(len(names))], names)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title)
        if counts:
            ax.legend()
    ax = axes[2]
    labels = list(OVERLAP_COLUMNS)[:5]  # Streaming DiLoCo's mean step is not a step's
    width = 0.8 / max(1, len(overlaps))
    for i, s in enumerate(overlaps):
        ax.bar(
            [j + i * width for j in range(len(labels))],
            [1e3 * (s.get(OVERLAP_COLUMNS[k]) or 0) for k in labels],
            width,
            label=f"{s['processes']} proc, XLA {s['xla']}",
        )
    ax.set_xticks([j + width * (len(overlaps) - 1) / 2 for j in range(len(labels))], labels)
    ax.set_ylabel("ms per step")
    ax.set_title("overlap: MLP sized so compute ~ psum")
    if overlaps:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--tables", default=",".join(TABLES))
    p.add_argument("--processes", default="2,4", help="process counts of allreduce and train")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--density", type=float, default=0.15)
    p.add_argument("--configs", default=TRAIN_CONFIGS, help="train: configurations")
    p.add_argument("--models", default="mlp,lm", help="train: mlp and/or lm")
    p.add_argument("--steps", type=int, default=6, help="train and overlap: timed steps")
    p.add_argument("--features", type=int, default=FEATURES)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--batch-per-device", type=int, default=BATCH)
    p.add_argument("--overlap-processes", default="2")
    p.add_argument("--overlap-configs", default=OVERLAP_CONFIGS)
    p.add_argument("--xla-settings", default=",".join(XLA_SETTINGS))
    p.add_argument("--max-batch", type=int, default=65536, help="overlap: largest batch per rank")
    p.add_argument("--json", default=None, help="also write the JSON object here")
    p.add_argument("--plot", default=None, help="a PNG of the three tables (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job (one launch)")
    p.add_argument(
        "--budget", type=float, default=math.inf, help="seconds for all jobs; later ones skipped"
    )
    p.add_argument("--worker", choices=("allreduce", "network", "overlap"), help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    # A network worker's own arguments follow "--", untouched by this parser.
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.rest = argv[cut + 1 :]
    for flag, given, known in (
        ("--tables", args.tables, TABLES),
        ("--models", args.models, network_worker.MODELS),
        ("--configs", args.configs, network_worker.TRAIN_CONFIGS),
        ("--overlap-configs", args.overlap_configs, network_worker.TRAIN_CONFIGS),
        ("--xla-settings", args.xla_settings, tuple(XLA_SETTINGS)),
    ):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:
            p.error(f"{flag}: unknown {unknown}; choose from {','.join(known)}")
    return args


def write_json(path: str | None, rows: list[dict], overlaps: list[dict]) -> dict:
    """The result object, also written to ``path`` (when given)."""
    result = {"rows": rows, "overlap": overlaps, "targets": targets(rows, overlaps)}
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


def flags(**options) -> list[str]:
    """``--name value`` for each option (underscores as dashes)."""
    return [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def process_counts(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        # Before JAX starts NCCL: each process is its own host.
        os.environ["NCCL_HOSTID"] = "jaxcomm-host-" + os.environ["JAXCOMM_PROCESS_ID"]
        if args.worker == "network":
            return network_worker.main(args.rest)
        return {"allreduce": allreduce_worker, "overlap": overlap_worker}[args.worker](args)

    tables = args.tables.split(",")
    # Overlap before train: a budget that runs out cuts the training table.
    jobs = []  # (table, processes, model or XLA setting, worker argv)
    size = flags(steps=args.steps, features=args.features, hidden=args.hidden)
    for n in process_counts(args.processes) if "allreduce" in tables else []:
        options = flags(mib=args.mib, repeats=args.repeats, density=args.density)
        jobs.append(("allreduce", n, None, ["--worker", "allreduce", *options]))
    for n in process_counts(args.overlap_processes) if "overlap" in tables else []:
        for setting in args.xla_settings.split(","):
            options = flags(
                batch_per_device=args.batch_per_device,
                repeats=args.repeats,
                overlap_configs=args.overlap_configs,
                max_batch=args.max_batch,
            )
            jobs.append(("overlap", n, setting, ["--worker", "overlap", *options, *size]))
    for model in args.models.split(",") if "train" in tables else []:
        for n in process_counts(args.processes):
            options = flags(
                workload="train",
                model=model,
                configs=args.configs,
                batch_per_device=args.batch_per_device,
            )
            jobs.append(("train", n, model, ["--worker", "network", "--", *options, *size]))

    rows, overlaps = [], []
    deadline = time.monotonic() + args.budget
    for table, n, detail, argv in jobs:
        left = deadline - time.monotonic()
        if left < 20:
            rows.append({"table": table, "processes": n, "error": "skipped: --budget spent"})
            continue
        if detail == "lm" and importlib.util.find_spec("flax") is None:  # examples/lm is NNX
            skipped = "skipped: flax is not installed"
            rows.append({"table": table, "processes": n, "model": detail, "error": skipped})
            continue
        xla = XLA_SETTINGS[detail] if table == "overlap" else ""
        got = launch(n, argv, min(args.timeout, left), xla)
        for r in got:
            r.update(table=table, processes=n)
        if table == "overlap":
            # The compute probes come before the collective's row.
            probes = next((i for i, r in enumerate(got) if "time_s" in r), 0)
            for i, r in enumerate(got):
                r["xla"] = detail
                r["probe"] = i < probes
            overlaps.append({"processes": n, "xla": detail, **overlap_summary(got)})
        if table == "train":
            timed = {r["config"]: r["mean_step_s"] for r in got if "mean_step_s" in r}
            for r in got:
                r["model"] = detail
                if "dense" in timed and "mean_step_s" in r:
                    r["speedup_vs_dense"] = timed["dense"] / r["mean_step_s"]
        rows += got
        if args.json:  # after every job: what a killed run measured stays
            write_json(args.json, rows, overlaps)
    checks = targets(rows, overlaps)
    print_tables(rows, overlaps, checks)
    result = write_json(args.json, rows, overlaps)
    if args.plot:
        plot(rows, overlaps, args.plot)
    print(json.dumps(result))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
