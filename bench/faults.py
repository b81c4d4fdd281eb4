"""Fault injection: replica groups that die, freeze and slow down, against a fault-free run.

Runs ``examples/fault_tolerance/train.py`` under ``python -m jaxcomm.launch
--replicas N`` twice, side by side in time on the same machine: once without
faults and once with a fault every ``--fault-every`` rounds, the kinds in turn:

- ``kill_inner``: SIGKILL halfway through a round's inner steps (DiLoCo);
- ``kill_exchange``: SIGKILL as the round's exchange starts;
- ``stop_exchange``: SIGSTOP for ``--timeout`` + 4 s as the exchange starts
  (longer than the round's deadline), then SIGCONT;
- ``kill_vote``: SIGKILL after the exchange, before the vote;
- ``slow``: a group sleeps half the deadline before the exchange (never evicted);
- ``lighthouse``: the lighthouse is SIGKILLed (the launcher restarts it).

The launcher restarts killed groups; they heal from a live peer. It prints
one row per fault kind and the run's totals (every round committed or aborted
within how long of its fault, hashes equal after every committed round, final
loss, goodput) and writes them to ``--json``::

    python bench/faults.py --replicas 4 --rounds 300 --sync-every 20 --fault-every 3
    python bench/faults.py --quick          # the slow test tier's form

Everything it starts is in the launcher's process groups and is killed at
the end or after ``--time-limit`` seconds. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "fault_tolerance", "train.py")
KINDS = ("kill_inner", "kill_exchange", "stop_exchange", "kill_vote", "slow", "lighthouse")
# The kinds a group's injector carries out, as (phase, action) of jaxcomm.ft.faults;
# the lighthouse is killed by this harness itself.
INJECTED = {
    "kill_inner": ("inner", "kill"),
    "kill_exchange": ("exchange", "kill"),
    "stop_exchange": ("exchange", "stop"),
    "kill_vote": ("vote", "kill"),
    "slow": ("exchange", "sleep"),
}
KIND_OF = {pair: kind for kind, pair in INJECTED.items()}
WINDOW_TOKENS = 64  # predicted bytes per window of 65


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None, help="300; 24 with --quick")
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mode", choices=("diloco", "dp"), default="diloco")
    p.add_argument("--outer-lr", type=float, default=None, help="DiLoCo's; the example's default")
    p.add_argument("--fault-every", type=int, default=3, help="rounds between faults")
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, in turn")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="a round's deadline (Replica timeout)"
    )
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument(
        "--time-limit", type=float, default=3600.0, help="seconds per run before it is killed"
    )
    p.add_argument(
        "--quick", action="store_true", help="3 groups, 24 rounds, H=10, 5 s deadline: the CI form"
    )
    p.add_argument("--skip-baseline", action="store_true", help="only the run with faults")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, help="a folder to keep the runs' logs and plans in")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.sync_every, args.eval_every = 3, 10, 6
        args.rounds = args.rounds or 24
        args.kinds = "kill_inner,kill_exchange,stop_exchange,slow,lighthouse,kill_vote"
        args.timeout = 5.0
    args.rounds = args.rounds or 300
    args.kinds = args.kinds.split(",")
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        p.error(f"--kinds: unknown {bad}; choose from {KINDS}")
    if args.mode == "dp":
        args.kinds = [k for k in args.kinds if k != "kill_inner"]  # a dp round has no inner steps
    return args


class Scheduler:
    """Adds a fault every ``fault_every`` rounds while the run goes, for a group it sees alive.

    A static plan would aim at groups that are down or being restarted by then;
    this one reads the run's log and writes the next fault two rounds ahead
    (eight for per-step rounds), for a group that committed the latest round,
    in its current incarnation.
    """

    def __init__(self, args, plan_path: str):
        self.args, self.plan_path = args, plan_path
        self.faults: list[dict] = []
        self.lighthouse_at: list[int] = []
        self.next_round, self.count = args.fault_every, 0
        self._write()

    def _write(self):
        with open(self.plan_path + ".tmp", "w") as f:
            json.dump(self.faults, f)
        os.replace(self.plan_path + ".tmp", self.plan_path)

    def update(self, latest: dict[int, dict], done: int) -> None:
        args = self.args
        # Per-step rounds go by faster than this harness looks at the log: aim further ahead.
        lead = 2 if args.mode == "diloco" else 8
        if self.next_round >= args.rounds - 1 or done < self.next_round - lead:
            return
        kind = args.kinds[self.count % len(args.kinds)]
        targeted = {f["replica"] for f in self.faults if f["round"] >= done}
        live = sorted(r for r, e in latest.items() if e["round"] >= done - 1 and r not in targeted)
        if kind == "lighthouse":
            self.lighthouse_at.append(self.next_round)
        elif live:
            replica = live[self.count % len(live)]
            phase, action = INJECTED[kind]
            seconds = {"stop": args.timeout + 4.0, "sleep": args.timeout / 2}.get(action, 0.0)
            fault = {
                "replica": replica,
                "incarnation": latest[replica]["incarnation"],
                "round": self.next_round,
            }
            self.faults.append({**fault, "phase": phase, "action": action, "seconds": seconds})
            self._write()
        else:
            return  # nobody to aim at yet; try again at the next look
        self.count += 1
        self.next_round += args.fault_every


def read_log(log_path: str, offset: int, latest: dict) -> tuple[int, int]:
    """Reads new log lines from ``offset``; updates ``latest`` (replica -> its last round entry)."""
    try:
        with open(log_path) as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset, max((e["round"] for e in latest.values()), default=0)
    complete = chunk[: chunk.rfind("\n") + 1]
    for line in complete.splitlines():
        entry = json.loads(line)
        if entry.get("committed"):
            latest[entry["replica"]] = entry
    return offset + len(complete), max((e["round"] for e in latest.values()), default=0)


def _lighthouse_pids(job_id: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"jaxcomm.ft.lighthouse" in argv and job_id.encode() in argv:
                pids.append(int(pid))
    return pids


def run(args, label: str, workdir: str, faults: bool = False) -> dict:
    """One launcher run; returns its log entries, fired faults and wall times."""
    log = os.path.join(workdir, f"{label}.jsonl")
    job_id = f"faults-{label}-{os.getpid()}"
    env = dict(os.environ)
    env.pop("JAXCOMM_FT_FAULTS", None)
    scheduler = None
    if faults:
        env["JAXCOMM_FT_FAULTS"] = os.path.join(workdir, f"{label}.plan.json")
        scheduler = Scheduler(args, env["JAXCOMM_FT_FAULTS"])
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    command = [
        sys.executable,
        "-m",
        "jaxcomm.launch",
        "--replicas",
        str(args.replicas),
        "--job-id",
        job_id,
    ]
    command += ["--max-restarts", "1000", TRAIN, "--mode", args.mode, "--rounds", str(args.rounds)]
    command += [
        "--sync-every",
        str(args.sync_every),
        "--batch",
        str(args.batch),
        "--timeout",
        str(args.timeout),
    ]
    command += ["--eval-every", str(args.eval_every), "--log", log]
    if args.outer_lr is not None:
        command += ["--outer-lr", str(args.outer_lr)]
    print(f"[{label}] {' '.join(command[1:])}", flush=True)
    start = time.time()
    proc = subprocess.Popen(
        command, env=env, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed_lighthouse, latest, offset = [], {}, 0
    last = -1
    try:
        while proc.poll() is None:
            if time.time() - start > args.time_limit:
                raise TimeoutError(f"{label}: not done in {args.time_limit:.0f} s")
            offset, done = read_log(log, offset, latest)
            if done != last and done % max(args.rounds // 10, 1) == 0:
                print(
                    f"[{label}] {done}/{args.rounds} rounds committed, {time.time() - start:.0f} s",
                    flush=True,
                )
            last = done
            if scheduler:
                scheduler.update(latest, done)
            if scheduler and scheduler.lighthouse_at and done >= scheduler.lighthouse_at[0]:
                scheduler.lighthouse_at.pop(0)
                for pid in _lighthouse_pids(job_id):
                    os.kill(pid, signal.SIGKILL)
                killed_lighthouse.append(
                    {"kind": "lighthouse", "round": done + 1, "time": time.time()}
                )
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=5)
    entries = []
    with open(log) as f:
        entries = [json.loads(line) for line in f]
    fired = list(killed_lighthouse)
    if faults and os.path.exists(env["JAXCOMM_FT_FAULTS"] + ".fired"):
        with open(env["JAXCOMM_FT_FAULTS"] + ".fired") as f:
            for line in f:
                fault = json.loads(line)
                fired.append({**fault, "kind": KIND_OF[fault["phase"], fault["action"]]})
    return {
        "label": label,
        "code": proc.returncode,
        "entries": entries,
        "fired": fired,
        "wall_s": time.time() - start,
    }


def analyse(result: dict, args) -> dict:
    """What the run did: per-round outcomes, hashes, faults' costs, tokens and losses."""
    entries = [e for e in result["entries"] if "committed" in e]
    by_round: dict[int, list] = {}
    for e in entries:
        if e["committed"]:
            by_round.setdefault(e["round"], []).append(e)
    tokens_per = args.batch * WINDOW_TOKENS * (args.sync_every if args.mode == "diloco" else 1)
    # Round 0 is the join round; a round's contributors are the same on every member.
    committed = {r: es[0]["contributors"] for r, es in by_round.items() if r > 0}
    mismatched = sorted(r for r, es in by_round.items() if len({e["state_hash"] for e in es}) > 1)
    hashes_equal = not mismatched
    rounds_committed = sorted(committed)
    # A round's time: when its first member logged it.
    times = sorted(min(e["time"] for e in es) for r, es in by_round.items() if r > 0)
    first = min((e["time"] for e in entries if e["committed"] and e["round"] == 1), default=None)
    last = max((e["time"] for e in entries if e["committed"]), default=None)
    durations = [b - a for a, b in zip(times, times[1:], strict=False) if b > a]
    normal = statistics.median(durations) if durations else 0.0
    faults = []
    for fault in sorted(result["fired"], key=lambda f: f["time"]):
        # The fault's round decided on another group: committed as round r, or aborted
        # (logged with the round before it, the one it rolled back to).
        after = [
            e
            for e in entries
            if e["time"] > fault["time"]
            and e["replica"] != fault.get("replica")
            and e["round"] >= fault["round"] - (0 if e["committed"] else 1)
        ]
        outcome = min((e["time"] for e in after), default=None)
        commit = min((e["time"] for e in after if e["committed"]), default=None)
        faults.append(
            {
                **fault,
                "decided_s": None if outcome is None else outcome - fault["time"],
                "resumed_s": None if commit is None else commit - fault["time"],
            }
        )
    evals = sorted(
        {(e["round"], e["eval_loss"]) for e in result["entries"] if "eval_loss" in e},
        key=lambda x: x[0],
    )
    cumulative, tokens_at = 0, {0: 0}
    for r in range(1, max(rounds_committed, default=0) + 1):
        cumulative += committed.get(r, 0) * tokens_per
        tokens_at[r] = cumulative
    finals = [e["final_loss"] for e in result["entries"] if "final_loss" in e]
    return {
        "label": result["label"],
        "code": result["code"],
        "rounds": len(rounds_committed),
        "aborted": len({(e["epoch"]) for e in entries if not e["committed"]}),
        "hashes_equal": hashes_equal,
        "mismatched_rounds": mismatched,
        "healed": sum(e["healed"] for e in entries),
        "tokens": cumulative,
        "seconds": (last - first) if first and last else None,
        "round_s": normal,
        "final_loss": finals[-1] if finals else None,
        "curve": [(tokens_at.get(r, 0), loss) for r, loss in evals],
        "faults": faults,
        "wall_s": result["wall_s"],
    }


def loss_at(curve, tokens):
    """The fault-free curve's loss at ``tokens`` (linear between its points)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:], strict=False):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(t1 - t0, 1)
    return curve[-1][1] if curve else None


def report(base: dict | None, faulty: dict, args) -> list[dict]:
    rows = []
    for kind in args.kinds:
        fs = [f for f in faulty["faults"] if f["kind"] == kind]
        decided = [f["decided_s"] for f in fs if f["decided_s"] is not None]
        resumed = [f["resumed_s"] for f in fs if f["resumed_s"] is not None]
        rows.append(
            {
                "kind": kind,
                "fired": len(fs),
                "decided_max_s": max(decided, default=None),
                "resumed_max_s": max(resumed, default=None),
            }
        )
    print(f"\n{'fault':<15} {'fired':>5} {'decided (max s)':>16} {'next commit (max s)':>20}")
    for r in rows:
        d = "-" if r["decided_max_s"] is None else f"{r['decided_max_s']:.2f}"
        c = "-" if r["resumed_max_s"] is None else f"{r['resumed_max_s']:.2f}"
        print(f"{r['kind']:<15} {r['fired']:>5} {d:>16} {c:>20}")
    print(
        f"\nrun with faults: {faulty['rounds']} rounds committed, {faulty['aborted']} aborted, "
        f"{faulty['healed']} heals, hashes equal after every committed round: "
        f"{faulty['hashes_equal']} {faulty['mismatched_rounds'] or ''}, "
        f"exit code {faulty['code']}"
    )
    if base is not None:
        rate = base["tokens"] / base["seconds"] if base["seconds"] else float("nan")
        goodput = (
            faulty["tokens"] / (rate * faulty["seconds"]) if faulty["seconds"] else float("nan")
        )
        reference = loss_at(base["curve"], faulty["tokens"])
        print(
            f"fault-free: {base['rounds']} rounds in {base['seconds']:.1f} s "
            f"({base['round_s']:.2f} s a round), "
            f"final loss {base['final_loss']:.4f}, hashes equal: {base['hashes_equal']}"
        )
        print(
            f"with faults: {faulty['tokens']:,} committed tokens in {faulty['seconds']:.1f} s, "
            f"final loss {faulty['final_loss']:.4f}; fault-free at equal tokens {reference:.4f} "
            f"({100 * (faulty['final_loss'] / reference - 1):+.1f}%); goodput {100 * goodput:.0f}%"
        )
        faulty["goodput"], faulty["loss_reference"] = goodput, reference
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jaxcomm-faults-") as workdir:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            workdir = args.keep
        base = None if args.skip_baseline else analyse(run(args, "fault-free", workdir), args)
        faulty = analyse(run(args, "faults", workdir, faults=True), args)
    rows = report(base, faulty, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "rows": rows, "fault_free": base, "faults": faulty},
                f,
                indent=1,
            )
    ok = faulty["code"] == 0 and faulty["hashes_equal"] and (base is None or base["code"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
