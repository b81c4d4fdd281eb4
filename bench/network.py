"""Collectives and training across processes on shaped network links.

Starts ``--hosts`` processes, each in its own network namespace on one
bridge, every host's link shaped with ``tc tbf`` to ``--rate`` in both
directions (``bench/netbed.py``), and runs one workload in them
(``bench/network_worker.py``) with the variables ``python -m jaxcomm.launch``
sets, the coordinator on host 0's link address. Everything lives in private
namespaces and goes away with this command, on any exit.

Before each workload one TCP stream from host 1 to host 0 measures what the
shaped link really carries.

Workloads:

- ``allreduce``: every cross-process allreduce path (xla ``auto`` = gloo's
  psum, xla ``ring`` over ppermute, ``hierarchical`` with 2 devices per
  host; ``ffi``, jaxcomm's ring over its TCP transport, on request), each
  with wire float32/float16/bfloat16, at 1, 4, 16, 64 MiB float32 per
  device: median time, algbw = bytes/time, busbw = 2(H-1)/H x algbw for H
  hosts (what each host's link carries in a ring), and busbw as a fraction
  of the link rate. Bytes are the float32 bytes reduced,
  so a narrow wire can pass 100% (up to 200% for 2-byte wires); TCP/IP
  headers cap float32 at ~96% with a 1500-byte MTU.
- ``train``: a wide MLP (~21M parameters by default) trained with each
  gradient exchange configuration: median step time, one step in flight,
  held-out accuracy after every step, and the time to ``--target-acc``
  (steps to reach it x median step time). Then where each step goes against
  ``compute``'s step (no exchange): its bytes sent over the measured link,
  its collectives x a one-element allreduce's time, and the rest; for an
  exchange that one step starts and the next finishes (double buffering on
  CPU's ffi), how long it travelled and how long the next step waited for
  it, and with ``--png`` their timeline.
- ``train --fsdp F``: the same MLP sharded (HSDP, docs/sharded.md): its
  weight matrices split over the F devices of each process ("fsdp"),
  replicated across processes ("data", the shaped link), each configuration
  reducing over "data" only; ``dense`` is ``lax.pmean`` over "data" (dense
  HSDP), the table's ``/ dense`` each mean step over dense's.
- ``check``: a float16/bfloat16-wire allreduce against a float64 NumPy sum.

Needs root (namespaces); says so and exits 2 where they cannot be made.

Usage::

    python bench/network.py --workload allreduce --rate 100mbit,1gbit --json ar.json
    python bench/network.py --workload train --rate 100mbit --hosts 4
    python bench/network.py --workload train --configs compute,allreduce_ffi,double_buffering_ffi \
        --hidden 512 --batch-per-device 3072 --png db.png   # compute ~ exchange: the overlap
    python bench/network.py --workload train --fsdp 2 --hosts 2 --rate 1gbit,100mbit
    python bench/network.py --check-link --rate 100mbit,1gbit,10gbit
    python bench/network.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "bench"), REPO]

import netbed  # noqa: E402  (beside this file)
import network_worker  # noqa: E402  (imports JAX only when run)
import timeline  # noqa: E402

WORKER = os.path.join(REPO, "bench", "network_worker.py")
ALL_CONFIGS = ",".join(network_worker.TRAIN_CONFIGS)
FSDP_CONFIGS = "dense,bf16,chunk_sparse,powersgd_r4,diloco_h10"  # --fsdp's default
QUICK = {
    "hosts": 2,
    "rate": "1gbit",
    "sizes_mib": "0.25,1",
    "paths": "auto,ring",
    "wires": "float32,float16",
    "repeats": 2,
    "configs": "dense,fp16,chunk_sparse",
    "hidden": 256,
    "features": 256,
    "steps": 2,
    "timeout": 300,
}
DEFAULTS = {
    "hosts": 4,
    "rate": "100mbit",
    "sizes_mib": "1,4,16,64",
    "paths": "auto,ring,hierarchical",
    "wires": "float32,float16,bfloat16",
    "repeats": 3,
    "configs": ALL_CONFIGS,
    "hidden": 4096,
    "features": 1024,
    "steps": 5,
    "timeout": 3600,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload", choices=("allreduce", "train", "check", "overlap"), default="allreduce"
    )
    parser.add_argument("--hosts", type=int, help="processes, one per namespace (default 4)")
    parser.add_argument(
        "--devices-per-host",
        type=int,
        choices=(1, 2),
        help="CPU devices per process; default 2 where a hierarchical path or config runs, else 1",
    )
    parser.add_argument(
        "--rate", help="link rate(s), comma-separated: 100mbit,1gbit,10gbit (default 100mbit)"
    )
    parser.add_argument("--sizes-mib", help="allreduce sizes per device (default 1,4,16,64)")
    parser.add_argument(
        "--paths",
        help="allreduce paths (default auto,ring,hierarchical; or ffi; overlap: auto, or auto,ffi)",
    )
    parser.add_argument("--wires", help="wire dtypes (default float32,float16,bfloat16)")
    parser.add_argument("--repeats", type=int, help="timed calls per allreduce (default 3)")
    parser.add_argument("--configs", help=f"training configurations (default {ALL_CONFIGS})")
    parser.add_argument("--steps", type=int, help="timed training steps (default 5)")
    parser.add_argument("--hidden", type=int, help="MLP hidden width (default 4096)")
    parser.add_argument("--features", type=int, help="MLP input width (default 1024)")
    parser.add_argument("--batch-per-device", type=int, default=32)
    parser.add_argument(
        "--fsdp",
        type=int,
        default=0,
        help="train: shard the MLP over F devices per process, data-parallel across them "
        f"(default configs {FSDP_CONFIGS})",
    )
    parser.add_argument("--params-out", help=argparse.SUPPRESS)  # tests: final params
    parser.add_argument(
        "--target-acc", type=float, default=0.9, help="train: held-out accuracy to time (0.9)"
    )
    parser.add_argument("--quick", action="store_true", help="a run of a few minutes")
    parser.add_argument("--check-link", action="store_true", help="only measure the links")
    parser.add_argument("--json", help="write result rows to this file")
    parser.add_argument(
        "--png", help="train: a timeline of the steps and of each exchange that outlives one"
    )
    parser.add_argument("--timeout", type=float, help="seconds for the whole run (default 3600)")
    parser.add_argument("--fail-rank", type=int, help=argparse.SUPPRESS)  # tests: teardown
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    if args.fsdp:
        if args.workload != "train" or args.devices_per_host not in (None, args.fsdp):
            parser.error(f"--fsdp {args.fsdp}: --workload train, --devices-per-host {args.fsdp}")
        args.devices_per_host = args.fsdp
        base = {**base, "configs": FSDP_CONFIGS}
    if args.workload == "overlap" and args.paths is None:
        args.paths = "auto"  # lax.psum; add ffi to compare jaxcomm's allreduce
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.rates = [netbed.parse_rate(r) for r in args.rate.split(",") if r.strip()]
    except ValueError as e:
        parser.error(str(e))
    for flag, given, known in (
        (
            "--paths",
            args.paths,
            network_worker.OVERLAP_PATHS if args.workload == "overlap" else network_worker.PATHS,
        ),
        ("--wires", args.wires, network_worker.WIRES),
        ("--configs", args.configs, network_worker.TRAIN_CONFIGS),
    ):
        unknown = [name for name in given.split(",") if name not in known]
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; choose from {','.join(known)}")
    if not 0 < args.target_acc <= 1:
        parser.error(f"--target-acc {args.target_acc}: an accuracy in (0, 1]")
    if args.hosts < 2:
        parser.error(f"--hosts {args.hosts}: need at least 2")
    if args.devices_per_host is None:
        wants = {"allreduce": args.paths, "train": args.configs}.get(args.workload, "")
        args.devices_per_host = 2 if "hierarchical" in wants.split(",") else 1
    return args


def say(message: str):
    print(f"network: {message}", file=sys.stderr, flush=True)


def worker_argv(args) -> list[str]:
    argv = [sys.executable, WORKER, "--workload", args.workload]
    for flag in ("paths", "wires", "sizes_mib", "repeats", "configs", "steps", "hidden"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    argv += ["--features", str(args.features), "--batch-per-device", str(args.batch_per_device)]
    argv += ["--target-acc", str(args.target_acc), "--fsdp", str(args.fsdp)]
    if args.params_out:
        argv += ["--params-out", args.params_out]
    if args.fail_rank is not None:
        argv += ["--fail-rank", str(args.fail_rank)]
    return argv


def add_rates(row: dict, rate_bps: int) -> dict:
    """The row with the link rate, and for a timed allreduce its bandwidths."""
    row = {"rate_bps": rate_bps, **row}
    if "time_s" in row:
        hosts = row["hosts"]
        algbw = row["bytes"] / row["time_s"]
        row["algbw_Bps"] = algbw
        row["busbw_Bps"] = 2 * (hosts - 1) / hosts * algbw
        row["link_fraction"] = row["busbw_Bps"] * 8 / rate_bps
    return row


def table(rows: list[dict], workload: str) -> str:
    if workload == "allreduce":
        head = (
            f"{'path':<13}{'wire':<10}{'size':>9}{'time s':>10}{'algbw MB/s':>12}"
            f"{'busbw MB/s':>12}{'link %':>8}"
        )
        lines = [head]
        for r in rows:
            size = f"{r['bytes'] / 2**20:g} MiB"
            if "time_s" in r:
                lines.append(
                    f"{r['path']:<13}{r['wire']:<10}{size:>9}{r['time_s']:>10.4f}"
                    f"{r['algbw_Bps'] / 1e6:>12.2f}{r['busbw_Bps'] / 1e6:>12.2f}"
                    f"{100 * r['link_fraction']:>7.1f}%"
                )
            else:
                lines.append(f"{r['path']:<13}{r['wire']:<10}{size:>9}  {r.get('error')}")
        return "\n".join(lines)
    if workload == "train":
        lines = [
            f"{'config':<19}{'step s':>9}{'mean s':>9}{'/ dense':>9}{'loss first -> last':>22}"
            f"{'accuracy':>10}{'steps to acc':>14}{'time to acc s':>15}"
        ]
        dense = next(
            (r["mean_step_s"] for r in rows if r["config"] == "dense" and "step_s" in r), 0
        )
        for r in rows:
            if "step_s" in r:
                loss = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}"
                acc = f"{r['acc_last']:.3f}" if "acc_last" in r else "-"
                steps, to_acc = r.get("steps_to_acc"), r.get("time_to_acc_s")
                ratio = f"{r['mean_step_s'] / dense:.2f}x" if dense else "-"
                lines.append(
                    f"{r['config']:<19}{r['step_s']:>9.3f}{r['mean_step_s']:>9.3f}{ratio:>9}"
                    f"{loss:>22}{acc:>10}{'-' if steps is None else steps:>14}"
                    f"{'-' if to_acc is None else f'{to_acc:.2f}':>15}"
                )
            else:
                lines.append(f"{r['config']:<19}  {r.get('error')}")
        return "\n".join(lines + breakdown(rows))
    if workload == "overlap":
        lines = [
            f"{'path':<6}{'size':>9}{'compute s':>11}{'allreduce s':>13}{'both s':>9}{'overlap':>9}"
        ]
        for r in rows:
            lines.append(
                f"{r['path']:<6}{r['bytes'] / 2**20:>5g} MiB{r['compute_s']:>11.3f}"
                f"{r['allreduce_s']:>13.3f}{r['both_s']:>9.3f}{r['overlap']:>9.2f}"
            )
        return "\n".join(lines)
    lines = [f"{'path':<13}{'wire':<10}{'max error / bound':>18}"]
    for r in rows:
        lines.append(f"{r['path']:<13}{r['wire']:<10}{r['max_error_over_bound']:>18.3g}")
    return "\n".join(lines)


def breakdown(rows: list[dict]) -> list[str]:
    """Where each configuration's step goes, against the compute-only step:
    ``wire`` is its bytes sent per device over the measured link rate,
    ``latency`` its collectives x a one-element allreduce's time on its
    backend, ``rest`` what the step takes beyond compute + wire + latency
    (encode, pack, waiting; negative where the exchange hides under compute).
    ``/ bound`` is the step over max(compute, wire + latency): what a step
    that hid the exchange completely would take."""
    compute = next((r["step_s"] for r in rows if r["config"] == "compute" and "step_s" in r), 0)
    link = next((r.get("measured_bps") for r in rows if r["config"] == "link"), None)
    timed = [r for r in rows if "bytes_sent" in r and "step_s" in r]
    if not (compute and timed):
        return []
    lines = [
        "",
        "where the step goes (s; wire at the measured link rate"
        f"{f' {link / 1e6:.1f} Mbit/s' if link else ''})",
        f"{'config':<22}{'step':>8}{'compute':>9}{'wire':>8}{'latency':>9}{'rest':>8}"
        f"{'/ compute':>11}{'/ bound':>9}",
    ]
    for r in timed:
        rate = (link or r["rate_bps"]) / 8
        wire = r["bytes_sent"] / rate
        lat = r["collectives"] * r["collective_latency_s"]
        rest = r["step_s"] - compute - wire - lat
        bound = max(compute, wire + lat)
        lines.append(
            f"{r['config']:<22}{r['step_s']:>8.3f}{compute:>9.3f}{wire:>8.3f}{lat:>9.3f}"
            f"{rest:>8.3f}{r['step_s'] / compute:>10.2f}x{r['step_s'] / bound:>8.2f}x"
        )
    return lines + [timeline.describe(r["config"], r) for r in timed if r.get("exchanges")]


def plot(rows: list[dict], path: str):
    """The timeline of each configuration whose exchanges outlive a step."""
    runs = {r["config"]: r for r in rows if r.get("exchanges")}
    if runs:
        title = (
            "orange: an exchange on the network, started as a step ends; "
            "red: the next step asks for it"
        )
        timeline.plot(runs, path, title)
        say(f"timeline in {path}")


def run_inside(args) -> int:
    def commands(rate, rows):
        del rate, rows
        return [] if args.check_link else [(args.workload, worker_argv(args))]

    def show(rows):
        print(
            f"{args.workload}, {args.hosts} hosts x {args.devices_per_host} devices"
            f"{', fsdp inside a host' if args.fsdp else ''}\n" + table(rows, args.workload),
            flush=True,
        )
        if args.png and args.workload == "train":
            plot(rows, args.png)

    return netbed.run_testbed(
        commands,
        netbed.Layout.of(args),
        say=say,
        link_s=2.0 if args.quick else 3.0,
        row_for=add_rates,
        on_rows=show,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get(netbed.INSIDE_ENV) == "1":
        return run_inside(args)
    argv = sys.argv[1:] if argv is None else list(argv)
    return netbed.rerun_isolated(__file__, argv, timeout_s=args.timeout + 60, say=say)


if __name__ == "__main__":
    sys.exit(main())
