"""What keeping host memory mapped (jaxcomm/_host_memory.py) does to a training step.

Runs ``bench/network_worker.py --workload train`` in one process on CPU
devices, once with ``JAXCOMM_KEEP_HOST_MEMORY=1`` (host memory kept) and
once without (glibc's malloc as it is, the default), alternating for
``--rounds`` rounds, and prints per configuration each one's median step,
their ratio and the page faults per step. Only the ratio of runs side by
side means anything on a shared machine.

    python bench/host_memory.py                                    # the LM, 4 devices
    python bench/host_memory.py --model mlp --hidden 1600 --devices 1 \\
        --configs compute,chunk_sparse_fp16_ffi,chunk_sparse_fp16_db_ffi
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "network_worker.py")
ROW = "@row "


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="lm", choices=("lm", "mlp"))
    p.add_argument("--configs", default="compute,dense,diloco_h10,chunk_sparse_ffi")
    p.add_argument("--devices", type=int, default=4, help="CPU devices of the one process")
    p.add_argument("--steps", type=int, default=12, help="timed steps per run")
    p.add_argument("--hidden", type=int, default=4096, help="mlp: width")
    p.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def run(args, keep: bool) -> list[dict]:
    """One run of the worker; its rows."""
    env = {
        **os.environ,
        "JAXCOMM_KEEP_HOST_MEMORY": "1" if keep else "",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
    }
    argv = [sys.executable, WORKER, "--workload", "train", "--model", args.model]
    argv += ["--configs", args.configs, "--steps", str(args.steps), "--hidden", str(args.hidden)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"host_memory: the worker failed:\n{out.stderr[-3000:]}")
    return [
        json.loads(line[len(ROW) :]) for line in out.stdout.splitlines() if line.startswith(ROW)
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for r in range(args.rounds):
        for keep in (True, False) if r % 2 == 0 else (False, True):
            print(
                f"round {r + 1}/{args.rounds}: host memory {'kept' if keep else 'left'}", flush=True
            )
            rows += [{**row, "kept": keep, "round": r} for row in run(args, keep)]
    print(f"\n{args.model}, {args.devices} CPU device(s) in one process, median step over rounds")
    print(
        f"{'config':<28}{'kept s':>9}{'left s':>9}{'left/kept':>11}{'faults kept':>13}{'left':>9}"
    )
    for config in args.configs.split(","):
        kept = [r for r in rows if r["config"] == config and r["kept"]]
        left = [r for r in rows if r["config"] == config and not r["kept"]]
        if not kept or not left:
            continue
        k = statistics.median(r["step_s"] for r in kept)
        lft = statistics.median(r["step_s"] for r in left)
        fk = statistics.median(r["page_faults_per_step"] for r in kept)
        fl = statistics.median(r["page_faults_per_step"] for r in left)
        print(f"{config:<28}{k:>9.3f}{lft:>9.3f}{lft / k:>10.2f}x{fk:>13.0f}{fl:>9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
