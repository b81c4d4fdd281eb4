"""Replica groups on one machine: ``python -m jaxcomm.launch --replicas N script.py args...``.

Fault-tolerant training runs N independent replica groups that meet only in
an exchange; a small coordinator, the lighthouse
(``python -m jaxcomm.ft.lighthouse``), keeps their heartbeats and forms a
quorum each round. :func:`launch_replicas` starts the lighthouse on
127.0.0.1, then the N groups (one process each, or M processes forming their
own ``jax.distributed`` job with the environment :func:`jaxcomm.launch.launch`
gives one job), and keeps them running:

- a group with a process that exits non-zero or dies by a signal is dead:
  its other processes are killed at once and the group starts again, with
  ``JAXCOMM_FT_INCARNATION`` one higher, at most ``max_restarts`` times;
  after that the whole job stops with that group's exit code;
- a group whose processes all exit 0 is finished; when every group has
  finished the lighthouse is stopped and the launcher returns 0;
- the lighthouse, whenever it exits, starts again on the same port with the
  same job id, without limit: surviving a coordinator restart is the point.

Every process gets ``JAXCOMM_FT_LIGHTHOUSE`` (``127.0.0.1:port``),
``JAXCOMM_FT_JOB_ID`` and ``JAXCOMM_FT_REPLICAS``; the groups' processes also
``JAXCOMM_FT_REPLICA_ID`` and ``JAXCOMM_FT_INCARNATION``. Output lines come
back prefixed ``[lighthouse]``, ``[replica i]`` or (M > 1)
``[replica i rank r]``. Every child runs in its own session and is stopped
by process group, so that neither Ctrl-C in a terminal nor a dead launcher
child leaves anything behind.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxcomm.distributed.startup import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    JAX_ENV_COORDINATOR,
)
from jaxcomm.launch import (
    GLOO_CONNECTED,
    _Interrupted,
    _raise_interrupted,
    _say,
    _signal_group,
    describe,
    exit_code,
    free_port,
    process_env,
    start_prefixed,
    stop_all,
    with_device_count,
)

ENV_LIGHTHOUSE = "JAXCOMM_FT_LIGHTHOUSE"
ENV_JOB_ID = "JAXCOMM_FT_JOB_ID"
ENV_REPLICA_ID = "JAXCOMM_FT_REPLICA_ID"
ENV_REPLICAS = "JAXCOMM_FT_REPLICAS"
ENV_INCARNATION = "JAXCOMM_FT_INCARNATION"
# How often the launcher looks at its children: restarts within a tenth of a
# second, and no busy wait.
POLL_SECONDS = 0.1
HOST = "127.0.0.1"


def default_lighthouse_command(port: int, job_id: str, replicas: int = 1) -> list[str]:
    """The default lighthouse: ``jaxcomm.ft.lighthouse`` on ``127.0.0.1:port``.

    Examples:
      >>> default_lighthouse_command(1234, "ab", 3)[3:]
      ['--host', '127.0.0.1', '--port', '1234', '--job-id', 'ab', '--replicas', '3']
    """
    return [sys.executable, "-m", "jaxcomm.ft.lighthouse"] + [
        *("--host", HOST),
        *("--port", str(port)),
        *("--job-id", job_id),
        *("--replicas", str(replicas)),
    ]


@dataclass
class _Group:
    replica: int
    incarnation: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    restart_at: float | None = None  # set while a restart waits for its delay
    finished: bool = False


class _Children:
    """Starts children in their own sessions with prefixed output, and keeps
    every coordinator port handed out so that no two groups share one."""

    def __init__(self, hide):
        self.hide = hide
        self.lock = threading.Lock()
        self.pumps: list = []  # the output pumps' threads
        self.ports: set[int] = set()

    def fresh_port(self) -> int:
        # free_port releases its port: two calls in a row may return the same.
        while (port := free_port()) in self.ports:
            pass
        self.ports.add(port)
        return port

    def start(self, command: Sequence[str], env: dict, prefix: str) -> subprocess.Popen:
        return start_prefixed(command, env, prefix, self.lock, self.hide, self.pumps)

    def join(self, timeout: float):
        for pump in self.pumps:
            pump.join(timeout)


def _check(name: str, value, low, allow_none: bool = False):
    if value is None and allow_none:
        return
    if value is None or value < low:
        raise ValueError(f"{name}={value} must be at least {low}")


def launch_replicas(
    command: Sequence[str],
    replicas: int,
    *,
    processes_per_replica: int = 1,
    devices_per_process: int | None = None,
    max_restarts: int = 3,
    restart_delay: float = 1.0,
    lighthouse_port: int | None = None,
    job_id: str | None = None,
    grace_period: float = 5.0,
    lighthouse_command: Sequence[str] | None = None,
    show_gloo: bool = False,
) -> int:
    """Runs a lighthouse and ``replicas`` groups of ``command``; restarts dead groups.

    Args:
      command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
      replicas: how many replica groups to run.
      processes_per_replica: processes per group; more than one form their
        own ``jax.distributed`` job, with a coordinator port of their own.
      devices_per_process: CPU devices to force in each process, or ``None``
        to leave ``XLA_FLAGS`` as it is.
      max_restarts: how many times each group may be restarted before the
        job fails.
      restart_delay: seconds between a death (group or lighthouse) and the restart.
      lighthouse_port: the lighthouse's port on 127.0.0.1; a free one if ``None``.
      job_id: the job's id for the lighthouse; 16 random hex digits if ``None``.
      grace_period: seconds between SIGTERM and SIGKILL when the lighthouse
        is stopped or the launcher interrupted. Dead groups are killed at once.
      lighthouse_command: replaces the default lighthouse command
        (:func:`default_lighthouse_command`); it gets the same ``JAXCOMM_FT_*``
        environment.
      show_gloo: pass on gloo's lines saying each device connected to its peers.

    Returns:
      0 once every group finished; the exit code of a group out of restarts
      (128 + N for signal N); 130 / 143 after SIGINT / SIGTERM.
    """
    _check("replicas", replicas, 1)
    _check("processes_per_replica", processes_per_replica, 1)
    _check("devices_per_process", devices_per_process, 1, allow_none=True)
    _check("max_restarts", max_restarts, 0)
    _check("restart_delay", restart_delay, 0)
    _check("grace_period", grace_period, 0)
    if lighthouse_port is not None and not 1 <= lighthouse_port <= 65535:
        raise ValueError(f"lighthouse_port={lighthouse_port} must be in 1..65535")
    children = _Children(hide=None if show_gloo else GLOO_CONNECTED)
    port = lighthouse_port or children.fresh_port()
    children.ports.add(port)
    job_id = job_id or secrets.token_hex(8)
    if lighthouse_command is None:
        lighthouse_command = default_lighthouse_command(port, job_id, replicas)
    base = dict(os.environ)
    # Set by an outer launcher, these would make a one-process group join
    # that job; a group of M gets its own from process_env.
    for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, JAX_ENV_COORDINATOR):
        base.pop(name, None)
    base.update(
        {
            ENV_LIGHTHOUSE: f"{HOST}:{port}",
            ENV_JOB_ID: job_id,
            ENV_REPLICAS: str(replicas),
            "PYTHONUNBUFFERED": "1",
        }
    )

    def start_lighthouse() -> subprocess.Popen:
        return children.start(lighthouse_command, dict(base), "[lighthouse] ")

    def start_group(group: _Group):
        many = processes_per_replica > 1
        group_port = children.fresh_port() if many else None
        group.procs = []
        for rank in range(processes_per_replica):
            if many:
                env = process_env(
                    base,
                    rank=rank,
                    num_processes=processes_per_replica,
                    port=group_port,
                    devices_per_process=devices_per_process,
                )
            else:
                env = dict(base)
                if devices_per_process is not None:
                    xla_flags = env.get("XLA_FLAGS", "")
                    env["XLA_FLAGS"] = with_device_count(xla_flags, devices_per_process)
            env[ENV_REPLICA_ID] = str(group.replica)
            env[ENV_INCARNATION] = str(group.incarnation)
            rank_part = f" rank {rank}" if many else ""
            prefix = f"[replica {group.replica}{rank_part}] "
            group.procs.append(children.start(command, env, prefix))

    groups = [_Group(replica) for replica in range(replicas)]
    lighthouse: list[subprocess.Popen] = []  # the current one, once started
    failed = None
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            lighthouse.append(start_lighthouse())
            for group in groups:
                start_group(group)
            code, failed = _supervise(
                groups,
                lighthouse,
                start_group,
                start_lighthouse,
                processes_per_replica=processes_per_replica,
                max_restarts=max_restarts,
                restart_delay=restart_delay,
                address=f"{HOST}:{port}",
            )
        except _Interrupted as interrupt:
            name = signal.Signals(interrupt.signum).name
            _say(f"got {name}; stopping the lighthouse and {replicas} replica groups")
            code = 128 + interrupt.signum
        finally:
            # Whatever ended the run (an exception too), nothing stays behind.
            running = [p for g in groups for p in g.procs] + lighthouse
            try:
                stop_all(running, grace_period)
            except _Interrupted:  # asked again: no more waiting
                stop_all(running, 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    children.join(timeout=grace_period)
    if failed is not None:  # last, after the processes' final lines
        _say(f"exit code {code}: replica {failed} failed {max_restarts + 1} times")
    return code


def _supervise(
    groups: list[_Group],
    lighthouse: list[subprocess.Popen],
    start_group,
    start_lighthouse,
    *,
    processes_per_replica: int,
    max_restarts: int,
    restart_delay: float,
    address: str,
) -> tuple[int, int | None]:
    """Watches the groups and the lighthouse until every group finished or one
    ran out of restarts. Returns (exit code, the replica that failed or None)."""
    lighthouse_restart_at = None
    while True:
        now = time.monotonic()
        for group in groups:
            if group.finished:
                continue
            if group.restart_at is not None:
                if now >= group.restart_at:
                    group.restart_at = None
                    group.incarnation += 1
                    start_group(group)
                continue
            codes = [p.poll() for p in group.procs]
            if all(c is not None for c in codes):
                # Even after a clean exit: a daemon a process left must go too.
                _kill_groups(group.procs)
            failures = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if not failures:
                group.finished = all(c == 0 for c in codes)
                continue
            rank, returncode = failures[0]
            who = f"replica {group.replica}"
            if processes_per_replica > 1:
                who += f" rank {rank}"
            others = [r for r, c in enumerate(codes) if c is None]
            stopping = f"; stopping ranks {others}" if others else ""
            # Its peers are blocked in collectives and JAX ignores SIGTERM: kill.
            stop_all(group.procs, grace_period=0)
            _kill_groups(group.procs)
            if group.incarnation >= max_restarts:
                _say(
                    f"{describe(who, returncode)}{stopping}; no restarts left "
                    f"({max_restarts} used); stopping everything"
                )
                everyone = [p for g in groups for p in g.procs]
                stop_all(everyone, grace_period=0)
                return exit_code(returncode), group.replica
            _say(
                f"{describe(who, returncode)}{stopping}; restarting replica {group.replica} "
                f"as incarnation {group.incarnation + 1} in {restart_delay:g} s "
                f"(restart {group.incarnation + 1} of {max_restarts})"
            )
            group.restart_at = now + restart_delay
        if all(group.finished for group in groups):
            return 0, None
        if lighthouse_restart_at is None and (returncode := lighthouse[0].poll()) is not None:
            _kill_groups(lighthouse)
            _say(
                f"{describe('the lighthouse', returncode)}; restarting it on {address} "
                f"in {restart_delay:g} s"
            )
            lighthouse_restart_at = now + restart_delay
        if lighthouse_restart_at is not None and now >= lighthouse_restart_at:
            lighthouse_restart_at = None
            lighthouse[0] = start_lighthouse()
        time.sleep(POLL_SECONDS)


def _kill_groups(procs: Sequence[subprocess.Popen]):
    """SIGKILL to the process groups of exited processes: what they started.

    Right after the exit, while the group id cannot belong to anyone else yet.
    """
    for proc in procs:
        if proc.returncode is not None:
            _signal_group(proc, signal.SIGKILL)
