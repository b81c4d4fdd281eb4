"""A replica group cut off by a partitioned link, on the testbed's network namespaces.

The lighthouse runs on host 0 and one replica group of
``examples/fault_tolerance/train.py`` on each of hosts 1..N, each listening on
its own link address (``10.77.0.k``). Once ``--cut-at`` rounds are committed,
the bridge side of one group's link goes down for ``--cut-seconds`` (longer
than the heartbeat timeout and the round's deadline), then up again. The group
is alive and computing throughout, but it cannot reach anyone. What should
happen:

- the others leave it out of their quorums and go on committing;
- its own rounds fail (no lighthouse, no peers), and it keeps asking;
- once the link is back, it is behind, heals from a peer (the hash is checked),
  and takes part again;
- after every committed round, every group that committed it holds the same bits.

It prints these facts and exits 1 if one does not hold::

    sudo python bench/ft_partition.py --groups 3 --rounds 60 --cut-at 6 --cut-seconds 12

Needs root, ``unshare``, ``ip`` and ``tc`` (bench/netbed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import faults
import netbed

PORT = 29400


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mode", choices=("diloco", "dp"), default="diloco")
    p.add_argument("--cut-at", type=int, default=6, help="committed rounds before the cut")
    p.add_argument("--cut-seconds", type=float, default=12.0)
    p.add_argument("--cut-group", type=int, default=2, help="which group (1..N) loses its link")
    p.add_argument("--timeout", type=float, default=5.0, help="a round's deadline")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not 1 <= args.cut_group <= args.groups:
        p.error(f"--cut-group must be in 1..{args.groups}")
    return args


def _commands(bed, args, log: str, job: str):
    lighthouse = [sys.executable, "-m", "jaxcomm.ft.lighthouse", "--job-id", job]
    lighthouse += [
        "--host",
        netbed.host_address(0),
        "--port",
        str(PORT),
        "--replicas",
        str(args.groups),
    ]
    groups = []
    for k in range(1, args.groups + 1):
        argv = [sys.executable, faults.TRAIN, "--mode", args.mode, "--rounds", str(args.rounds)]
        argv += ["--sync-every", str(args.sync_every), "--batch", str(args.batch)]
        argv += ["--timeout", str(args.timeout), "--host", netbed.host_address(k), "--log", log]
        env = {key: v for key, v in os.environ.items() if key != netbed.INSIDE_ENV}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [netbed.REPO, env.get("PYTHONPATH")]))
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        env["JAXCOMM_FT_LIGHTHOUSE"] = f"{netbed.host_address(0)}:{PORT}"
        env.update(JAXCOMM_FT_JOB_ID=job, JAXCOMM_FT_REPLICA_ID=str(k - 1))
        groups.append((bed.command(k, argv), env))
    return bed.command(0, lighthouse), groups


def inside(args) -> int:
    netbed.install_interrupt_handlers()
    # Not named by our pid: in run_isolated's PID namespace it is 1 on every run.
    fd, log = tempfile.mkstemp(prefix="ft-partition-", suffix=".jsonl")
    os.close(fd)
    procs = []
    cut = {}
    try:
        with netbed.Testbed(hosts=args.groups + 1, rate_bps=netbed.parse_rate(args.rate)) as bed:
            lighthouse, groups = _commands(bed, args, log, job=f"partition-{os.getpid()}")
            procs.append(subprocess.Popen(lighthouse, stdout=subprocess.DEVNULL))
            for argv, env in groups:
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
            port = bed.bridge_port(args.cut_group)
            start, latest, offset = time.monotonic(), {}, 0
            while any(p.poll() is None for p in procs[1:]):
                if time.monotonic() - start > args.time_limit:
                    raise TimeoutError(f"not done in {args.time_limit:.0f} s")
                offset, done = faults.read_log(log, offset, latest)
                now = time.time()
                if "down" not in cut and done >= args.cut_at:
                    subprocess.run(["ip", "link", "set", port, "down"], check=True)
                    cut["down"] = now
                    print(f"round {done}: link of group {args.cut_group - 1} down", flush=True)
                if "down" in cut and "up" not in cut and now - cut["down"] >= args.cut_seconds:
                    subprocess.run(["ip", "link", "set", port, "up"], check=True)
                    cut["up"] = now
                    print(f"round {done}: link up again", flush=True)
                time.sleep(0.2)
            codes = [p.poll() for p in procs[1:]]
    except netbed.Interrupted as e:
        return netbed.stopped(e, print)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    with open(log) as f:
        entries = [json.loads(line) for line in f]
    os.unlink(log)
    return report(args, entries, cut, codes)


def report(args, entries, cut: dict, codes) -> int:
    group = args.cut_group - 1
    rounds = [e for e in entries if "committed" in e]
    if "up" not in cut:
        print("the run ended before the link was cut and restored")
        return 1
    # Rounds that began (asked for their quorum) after the link went down: the round
    # in flight at the cut may still have it as a member.
    during = [e for e in rounds if cut["down"] <= e["time"] - e["seconds"] <= cut["up"]]
    others = sorted({e["round"] for e in during if e["committed"] and e["replica"] != group})
    left_out = all(
        group not in e["members"] for e in during if e["committed"] and e["replica"] != group
    )
    own = [e for e in rounds if e["replica"] == group and e["time"] >= cut["down"]]
    healed = [e for e in own if e["healed"] and e["time"] >= cut["up"]]
    result = faults.analyse(
        {"label": "partition", "code": 0, "entries": entries, "fired": [], "wall_s": 0}, args
    )
    facts = {
        "others committed rounds while it was cut off": others,
        "it was in none of their quorums then": left_out,
        "its rounds aborted while cut off": sum(
            not e["committed"] for e in own if e["time"] <= cut["up"]
        ),
        "it healed after the link came back, at round": healed[0]["round"] if healed else None,
        "seconds from link up to its heal": round(healed[0]["time"] - cut["up"], 2)
        if healed
        else None,
        "hashes equal after every committed round": result["hashes_equal"],
        "groups' exit codes": codes,
    }
    for key, value in facts.items():
        print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(facts, f, indent=1)
    ok = (
        bool(others)
        and left_out
        and bool(healed)
        and result["hashes_equal"]
        and codes == [0] * len(codes)
    )
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get(netbed.INSIDE_ENV) != "1":
        return netbed.rerun_isolated(
            __file__,
            sys.argv[1:] if argv is None else argv,
            timeout_s=args.time_limit + 60,
            say=print,
        )
    return inside(args)


if __name__ == "__main__":
    raise SystemExit(main())
