"""Local multi-process launcher: ``python -m jaxcomm.launch -n 2 script.py args...``.

With ``--replicas N`` it runs N fault-tolerant replica groups instead, each
of ``-n`` processes (default 1), beside a lighthouse that coordinates them,
and restarts a group that dies: see :mod:`jaxcomm.launch_replicas`. The rest
of this docstring is about the plain mode, one job of ``n`` processes.

Starts ``n`` copies of a Python script on this machine as the processes of one
``jax.distributed`` job: picks a free port on 127.0.0.1 for the coordinator,
gives each process ``JAXCOMM_COORDINATOR``, ``JAXCOMM_NUM_PROCESSES`` and
``JAXCOMM_PROCESS_ID`` (read by :func:`jaxcomm.distributed.initialize`, which
then binds rank 0's coordination service to 127.0.0.1 only), and with
``--devices-per-process`` forces that many CPU devices per process through
``XLA_FLAGS``; ``--one-gpu-each`` gives each process one GPU
(``CUDA_VISIBLE_DEVICES``, round robin over the visible ones: N processes
share one GPU or take one each). Each output line comes back prefixed with
``[rank k]``; gloo's line per device saying it connected to its peers is left
out unless ``--show-gloo`` asks for it.

If a process exits non-zero or dies by a signal, the others are killed
(SIGKILL) at once and the launcher exits with the failed process's code
(128 + signal for a signal) and a message naming its rank. Without that rank
the job cannot go on: its peers are blocked in collectives, and JAX catches
SIGTERM (its preemption notifier logs it and carries on), so a SIGTERM would
only delay the end. Ctrl-C (or SIGTERM to the launcher) sends the processes
SIGTERM, then SIGKILL after ``--grace-period`` seconds.

The launcher's own code is standard library only, but ``python -m
jaxcomm.launch`` first imports the ``jaxcomm`` package, and with it jax and
optax: it takes about as long to start as ``import jax`` (0.8 to 1 s on a
two-core machine, where ``import jax`` alone takes 0.7 s). It starts no JAX
backend and touches no device.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxcomm.distributed.startup import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    JAX_ENV_COORDINATOR,
)

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# How often the launcher wakes to notice Ctrl-C while it waits for exits.
WAKE_SECONDS = 0.2
# What gloo prints for every device once its connections are up: one line per
# device and process, on stdout, with nothing to say when all is well.
GLOO_CONNECTED = re.compile(
    rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    rb"Expected number of connected peer ranks is : \d+\s*$"
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now.

    The port is released before it is returned, so another program could take
    it in between; the coordinator binds it within a second, which makes that
    unlikely on a workstation.

    Examples:
      >>> 1024 <= free_port() <= 65535
      True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def with_device_count(xla_flags: str, count: int) -> str:
    """``xla_flags`` with the CPU device count set to ``count`` (replacing any).

    Examples:
      >>> with_device_count("--xla_force_host_platform_device_count=8 --foo", 4)
      '--foo --xla_force_host_platform_device_count=4'
    """
    kept = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG + "=")]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={count}"])


def visible_gpus(env: dict, nvidia_smi_listing: str | None = None) -> list[str]:
    """The GPUs processes may be given: ``CUDA_VISIBLE_DEVICES``'s entries
    where it is set, else one index per ``GPU k:`` line of ``nvidia-smi -L``
    (run here unless its output is passed in); empty without either.

    Examples:
      >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
      ['2', '3']
      >>> visible_gpus({}, "GPU 0: NVIDIA H100 (UUID: a)\\nGPU 1: NVIDIA H100 (UUID: b)")
      ['0', '1']
    """
    if env.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if nvidia_smi_listing is None:
        try:
            nvidia_smi_listing = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
    count = sum(1 for line in nvidia_smi_listing.splitlines() if re.match(r"GPU \d+:", line))
    return [str(i) for i in range(count)]


def process_env(
    base: dict,
    *,
    rank: int,
    num_processes: int,
    port: int,
    devices_per_process: int | None,
    gpus: Sequence[str] = (),
) -> dict:
    """The environment of process ``rank``: ``base`` plus the job's variables;
    with ``gpus``, the one GPU ``gpus[rank % len(gpus)]`` (``CUDA_VISIBLE_DEVICES``)."""
    env = dict(base)
    env.update(
        {
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(rank),
            "PYTHONUNBUFFERED": "1",  # lines arrive as they are printed, not at exit
        }
    )
    # Set by an outer launcher, these would contradict ours (see jaxcomm.distributed).
    env.pop(JAX_ENV_COORDINATOR, None)
    if devices_per_process is not None:
        env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices_per_process)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[rank % len(gpus)]
    return env


class _PrefixedOutput:
    """Copies a child's stream to ours line by line, each line prefixed;
    lines that ``hide`` matches are dropped."""

    def __init__(self, source, sink, prefix: str, lock: threading.Lock, hide=None):
        self._thread = threading.Thread(
            target=self._pump, args=(source, sink, prefix.encode(), lock, hide), daemon=True
        )
        self._thread.start()

    @staticmethod
    def _pump(source, sink, prefix: bytes, lock: threading.Lock, hide):
        out = getattr(sink, "buffer", sink)
        for line in iter(source.readline, b""):
            if hide is not None and hide.match(line):
                continue
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                out.write(prefix + line)
                out.flush()
        source.close()

    def join(self, timeout: float):
        self._thread.join(timeout)


def start_prefixed(command, env: dict, prefix: str, lock, hide, pumps: list) -> subprocess.Popen:
    """Starts ``command`` in its own session, its output lines prefixed (pumps go to ``pumps``)."""
    proc = subprocess.Popen(
        list(command),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Its own session: a terminal's Ctrl-C reaches only us, and we stop
        # the processes in order instead of racing them; killed by group.
        start_new_session=True,
    )
    pumps.append(_PrefixedOutput(proc.stdout, sys.stdout, prefix, lock, hide))
    pumps.append(_PrefixedOutput(proc.stderr, sys.stderr, prefix, lock, hide))
    return proc


def _signal_group(proc: subprocess.Popen, sig: int):
    try:
        os.killpg(proc.pid, sig)  # the child's own group: its subprocesses too
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(procs: Sequence[subprocess.Popen], grace_period: float) -> None:
    """SIGTERM to every running process, SIGKILL to those alive after the grace
    period (at once for a grace period of 0)."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        _signal_group(proc, signal.SIGTERM if grace_period > 0 else signal.SIGKILL)
    deadline = time.monotonic() + grace_period
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
    for proc in running:
        proc.wait()


def exit_code(returncode: int) -> int:
    """A shell-style exit code: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(rank: int | str, returncode: int) -> str:
    """What happened to a process, in words; ``rank`` is its rank, or its
    name as a string (e.g. ``"replica 2"``).

    Examples:
      >>> describe(1, -9)
      'rank 1 was killed by SIGKILL'
      >>> describe("replica 2", 3)
      'replica 2 exited with code 3'
    """
    who = rank if isinstance(rank, str) else f"rank {rank}"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{who} was killed by {name}"
    return f"{who} exited with code {returncode}"


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    del frame
    raise _Interrupted(signum)


def _say(message: str):
    print(f"jaxcomm.launch: {message}", file=sys.stderr, flush=True)


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    one_gpu_each: bool = False,
    grace_period: float = 5.0,
    show_gloo: bool = False,
) -> int:
    """Runs ``command`` as ``num_processes`` ranks of one job; returns the exit code.

    Args:
      command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
      num_processes: how many processes to start.
      devices_per_process: CPU devices to force in each process, or ``None``
        to leave ``XLA_FLAGS`` as it is.
      one_gpu_each: give each process one GPU of :func:`visible_gpus`, round
        robin (more processes than GPUs share them); the processes then see
        one local device each.
      grace_period: seconds between SIGTERM and SIGKILL when the launcher is
        interrupted. After a process fails the others are killed at once.
      show_gloo: pass on gloo's lines saying each device connected to its peers.

    Returns:
      0 if every process exited 0; otherwise the code of the first process to
      fail (128 + N for signal N), or 130 / 143 after SIGINT / SIGTERM.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be at least 1")
    gpus = visible_gpus(dict(os.environ)) if one_gpu_each else []
    if one_gpu_each and not gpus:
        raise ValueError("one_gpu_each: no GPU (CUDA_VISIBLE_DEVICES unset, nvidia-smi lists none)")
    port = free_port()
    lock = threading.Lock()
    hide = None if show_gloo else GLOO_CONNECTED
    procs, pumps = [], []
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(num_processes):
            env = process_env(
                dict(os.environ),
                rank=rank,
                num_processes=num_processes,
                port=port,
                devices_per_process=devices_per_process,
                gpus=gpus,
            )
            procs.append(start_prefixed(command, env, f"[rank {rank}] ", lock, hide, pumps))
        code, failed = _watch(procs)
    except _Interrupted as interrupt:
        name = signal.Signals(interrupt.signum).name
        _say(f"got {name}; stopping all {num_processes} processes")
        stop_all(procs, grace_period)
        code, failed = 128 + interrupt.signum, None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for pump in pumps:
        pump.join(timeout=grace_period)
    if failed is not None:  # last, after the ranks' final lines
        _say(f"exit code {code}: rank {failed} failed first")
    return code


def _watch(procs: Sequence[subprocess.Popen]) -> tuple[int, int | None]:
    """Waits for all processes; on the first failure kills the rest.
    Returns (exit code, first rank to fail or None).

    One thread per process reports its exit, so "first" is the order in which
    they exited, not their rank order.
    """
    exits: queue.Queue = queue.Queue()

    def report_exit(rank: int, proc: subprocess.Popen):
        exits.put((rank, proc.wait()))

    for rank, proc in enumerate(procs):
        threading.Thread(target=report_exit, args=(rank, proc), daemon=True).start()
    remaining = len(procs)
    while remaining:
        try:
            rank, returncode = exits.get(timeout=WAKE_SECONDS)
        except queue.Empty:
            continue
        remaining -= 1
        if returncode != 0:
            others = [r for r, p in enumerate(procs) if p.poll() is None]
            stopping = f"; stopping ranks {others}" if others else ""
            _say(f"{describe(rank, returncode)}{stopping}")
            stop_all(procs, grace_period=0)
            return exit_code(returncode), rank
    return 0, None


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomm.launch",
        description="Run a JAX script as N local processes of one jax.distributed job; "
        "with --replicas, as N fault-tolerant replica groups beside a lighthouse, "
        "restarting a group that dies.",
    )
    parser.add_argument(
        "-n",
        "--num-processes",
        type=int,
        default=None,
        help="processes of the job (required without --replicas); with --replicas, "
        "processes per replica group (default 1)",
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help=f"force this many CPU devices per process ({DEVICE_COUNT_FLAG} in XLA_FLAGS)",
    )
    parser.add_argument(
        "--one-gpu-each",
        action="store_true",
        help="give each process one GPU (CUDA_VISIBLE_DEVICES), round robin over the visible ones",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL after Ctrl-C, and for the lighthouse "
        "at the end (default 5); when a process fails the others are killed at once",
    )
    parser.add_argument(
        "--show-gloo",
        action="store_true",
        help="show gloo's lines saying each device connected to its peers (hidden by default)",
    )
    ft = parser.add_argument_group(
        "replica groups",
        "Fault-tolerant mode: every group gets JAXCOMM_FT_LIGHTHOUSE, JAXCOMM_FT_JOB_ID, "
        "JAXCOMM_FT_REPLICA_ID, JAXCOMM_FT_REPLICAS and JAXCOMM_FT_INCARNATION.",
    )
    ft.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run this many replica groups and a lighthouse (jaxcomm.ft.lighthouse) on 127.0.0.1",
    )
    ft.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="restarts allowed per group before the job fails (default 3)",
    )
    ft.add_argument(
        "--restart-delay",
        type=float,
        default=None,
        help="seconds before restarting a dead group or lighthouse (default 1)",
    )
    ft.add_argument(
        "--lighthouse-port",
        type=int,
        default=None,
        help="the lighthouse's port on 127.0.0.1 (default: a free one)",
    )
    ft.add_argument(
        "--job-id", default=None, help="the job id given to the lighthouse (default: random)"
    )
    parser.add_argument("script", help="Python script to run in every process")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    args = parser.parse_args(argv)
    replica_options = {
        "--max-restarts": args.max_restarts,
        "--restart-delay": args.restart_delay,
        "--lighthouse-port": args.lighthouse_port,
        "--job-id": args.job_id,
    }
    if args.replicas is None:
        if args.num_processes is None:
            parser.error("the following arguments are required: -n/--num-processes")
        for option, value in replica_options.items():
            if value is not None:
                parser.error(f"{option} needs --replicas")
    else:
        if args.replicas < 1:
            parser.error(f"--replicas {args.replicas}: need at least 1 replica group")
        if args.one_gpu_each:
            parser.error("--one-gpu-each does not work with --replicas")
        if args.num_processes is None:
            args.num_processes = 1
        if args.max_restarts is not None and args.max_restarts < 0:
            parser.error(f"--max-restarts {args.max_restarts}: must not be negative")
        if args.restart_delay is not None and args.restart_delay < 0:
            parser.error(f"--restart-delay {args.restart_delay}: must not be negative")
        if args.lighthouse_port is not None and not 1 <= args.lighthouse_port <= 65535:
            parser.error(f"--lighthouse-port {args.lighthouse_port}: must be in 1..65535")
        if args.job_id is not None and not args.job_id:
            parser.error("--job-id: must not be empty")
    if args.num_processes < 1:
        parser.error(f"-n {args.num_processes}: need at least 1 process")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error(f"--devices-per-process {args.devices_per_process}: need at least 1")
    if args.grace_period < 0:
        parser.error(f"--grace-period {args.grace_period}: must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if args.replicas is not None:
            # Imported here: jaxcomm.launch_replicas imports this module.
            from jaxcomm.launch_replicas import launch_replicas

            optional = {
                "max_restarts": args.max_restarts,
                "restart_delay": args.restart_delay,
                "lighthouse_port": args.lighthouse_port,
                "job_id": args.job_id,
            }
            return launch_replicas(
                [sys.executable, args.script, *args.args],
                args.replicas,
                processes_per_replica=args.num_processes,
                devices_per_process=args.devices_per_process,
                grace_period=args.grace_period,
                show_gloo=args.show_gloo,
                **{k: v for k, v in optional.items() if v is not None},
            )
        return launch(
            [sys.executable, args.script, *args.args],
            args.num_processes,
            devices_per_process=args.devices_per_process,
            one_gpu_each=args.one_gpu_each,
            grace_period=args.grace_period,
            show_gloo=args.show_gloo,
        )
    except ValueError as e:  # nothing was started
        _say(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
