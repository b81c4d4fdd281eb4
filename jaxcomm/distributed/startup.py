"""Multi-process start-up: ``jax.distributed`` from the usual environment.

Every process of a job calls :func:`initialize` before anything touches a JAX
device. It finds the coordinator address, the number of processes and this
process's id, in this order:

1. the arguments of :func:`initialize`;
2. ``JAXCOMM_COORDINATOR`` (or JAX's own ``JAX_COORDINATOR_ADDRESS``),
   ``JAXCOMM_NUM_PROCESSES`` and ``JAXCOMM_PROCESS_ID``, which
   ``python -m jaxcomm.launch`` sets;
3. Open MPI's ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_RANK`` (``mpirun``);
4. SLURM's ``SLURM_NTASKS`` / ``SLURM_PROCID`` (``srun``), with the first host
   of ``SLURM_JOB_NODELIST`` as coordinator.

Open MPI comes before SLURM because ``mpirun`` inside an ``sbatch`` script sees
the allocation's SLURM variables too, and only the MPI ones describe the ranks.

On CPU, JAX's collectives across processes run over gloo (TCP), which jax
0.10.2 selects by default (``jax_cpu_collectives_implementation="gloo"``) once
``jax.distributed`` is initialized; :func:`initialize` sets it explicitly so an
inherited ``"mpi"`` or ``None`` cannot leave CPU collectives single-process.
Its ``interface`` (or ``JAXCOMM_SOCKET_IFNAME``) chooses the network gloo
uses, and process 0's coordination service listens no wider than the
coordinator address needs (:mod:`jaxcomm.distributed.network`).

When a process dies, the others end too, non-zero, in seconds
(``docs/faults.md``): a collective with it fails as soon as its TCP connection
closes, and JAX's coordination service aborts every process once the dead one
has missed heartbeats for ``heartbeat_timeout_s`` (30 s here, JAX's default is
100 s). :func:`~jaxcomm.distributed.check_same_settings` makes the
processes compare their settings once at start, and
:func:`~jaxcomm.distributed.check_same_collectives` the collectives their
programs issue, which they would otherwise hang in when they differ.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from collections.abc import Mapping

import jax

from jaxcomm import _jax_compat
from jaxcomm.distributed import network

__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "ProcessSettings",
    "first_slurm_host",
    "initialize",
    "resolve_settings",
]

# The coordinator port under SLURM when none is given: derived from the job id,
# as JAX's own SLURM detection does, so every task of a job agrees without talking.
_SLURM_PORT_BASE = 65535 - 2**12 + 1

ENV_COORDINATOR = "JAXCOMM_COORDINATOR"
ENV_NUM_PROCESSES = "JAXCOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXCOMM_PROCESS_ID"
ENV_COORDINATOR_PORT = "JAXCOMM_COORDINATOR_PORT"
JAX_ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"

# Seconds without a heartbeat after which JAX's coordination service declares a
# process dead and aborts all of them. JAX's own default (100 s) lets a job sit
# on a frozen or vanished process for over a minute and a half; heartbeats come
# from a C++ thread, so a busy or slow Python step does not miss them.
HEARTBEAT_TIMEOUT_S = 30


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """Where this process stands in a multi-process job.

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordinator service;
        ``None`` for a single process, which needs none.
      num_processes: processes in the job.
      process_id: this process, ``0 <= process_id < num_processes``.
      source: where the count and id came from (``"arguments"``,
        ``"JAXCOMM_*"``, ``"Open MPI"``, ``"SLURM"`` or ``"default"``).
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int
    source: str


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM node list (``SLURM_JOB_NODELIST``).

    Args:
      nodelist: a list such as ``"gpu7"``, ``"gpu7,cpu2"`` or
        ``"node[003-010,012],login1"``.

    Returns:
      The first host, with its number as written (zero padding kept).

    Examples:
      >>> first_slurm_host("node[003-010,012],login1")
      'node003'
      >>> first_slurm_host("gpu7,cpu2")
      'gpu7'
    """
    match = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]*)\])?", nodelist)
    if match is None or not match.group(1):
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    first = re.split(r"[,-]", ranges, maxsplit=1)[0].strip()
    if not first:
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    return prefix + first


def as_int(value, name: str) -> int:
    """``value`` as an int, or a ValueError naming ``name``."""
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _count_and_id(env: Mapping[str, str], size_var: str, rank_var: str, source: str):
    """(count, id, source) from one pair of variables, or None if neither is set.
    Half a pair is an error: the other half must not be guessed from elsewhere."""
    size, rank = env.get(size_var), env.get(rank_var)
    if size is None and rank is None:
        return None
    if size is None or rank is None:
        have, missing = (size_var, rank_var) if rank is None else (rank_var, size_var)
        raise ValueError(f"{have} is set but {missing} is not; set both or neither")
    return as_int(size, size_var), as_int(rank, rank_var), source


def _env_coordinator(env: Mapping[str, str]) -> str | None:
    ours, jaxs = env.get(ENV_COORDINATOR), env.get(JAX_ENV_COORDINATOR)
    if ours and jaxs and ours != jaxs:
        raise ValueError(
            f"{ENV_COORDINATOR}={ours!r} and {JAX_ENV_COORDINATOR}={jaxs!r} disagree; "
            "set one of them"
        )
    return ours or jaxs or None


def _slurm_coordinator(env: Mapping[str, str]) -> str | None:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_STEP_NODELIST")
    if not nodelist:
        return None
    port = env.get(ENV_COORDINATOR_PORT)
    if port is None:
        if "SLURM_JOB_ID" not in env:
            return None
        port = as_int(env["SLURM_JOB_ID"], "SLURM_JOB_ID") % 2**12 + _SLURM_PORT_BASE
    return f"{first_slurm_host(nodelist)}:{as_int(port, ENV_COORDINATOR_PORT)}"


def _check_agrees(name: str, argument, env_name: str, env_value):
    if argument is not None and env_value is not None and argument != env_value:
        raise ValueError(
            f"{name}={argument!r} contradicts {env_name}={env_value!r} in the environment; "
            "pass the argument or set the variable, not both"
        )


def resolve_settings(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ProcessSettings:
    """Finds the coordinator, process count and process id; starts nothing.

    Arguments win over the environment, which is read in the order of the
    module docstring. An argument that contradicts a ``JAXCOMM_*`` variable is
    an error (both name this very process, so one of them is wrong).

    Args:
      coordinator_address: ``host:port`` of process 0.
      num_processes: processes in the job.
      process_id: this process's id.
      environ: the environment to read; ``os.environ`` by default.

    Returns:
      A :class:`ProcessSettings`. A lone process (nothing set anywhere, or a
      count of 1) gets ``ProcessSettings(None, 1, 0, ...)``.

    Raises:
      ValueError: half-set or non-integer variables, an id outside
        ``[0, num_processes)``, disagreeing settings, or several processes
        without a coordinator address.

    Examples:
      >>> env = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_ID": "77",
      ...        "SLURM_JOB_NODELIST": "gpu[12-13]"}
      >>> settings = resolve_settings(environ=env)
      >>> settings.coordinator_address, settings.num_processes, settings.process_id
      ('gpu12:61517', 4, 2)
      >>> resolve_settings(environ={}).num_processes  # nothing set: a lone process
      1
    """
    env = os.environ if environ is None else environ
    ours = _count_and_id(env, ENV_NUM_PROCESSES, ENV_PROCESS_ID, "JAXCOMM_*")
    env_coordinator = _env_coordinator(env)
    if ours is not None:
        _check_agrees("num_processes", num_processes, ENV_NUM_PROCESSES, ours[0])
        _check_agrees("process_id", process_id, ENV_PROCESS_ID, ours[1])
    _check_agrees("coordinator_address", coordinator_address, ENV_COORDINATOR, env_coordinator)

    scheduler = (
        ours
        or _count_and_id(env, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI")
        or _count_and_id(env, "SLURM_NTASKS", "SLURM_PROCID", "SLURM")
    )
    source = "arguments" if num_processes is not None and process_id is not None else "default"
    if num_processes is None or process_id is None:
        if scheduler is not None:
            count, rank, source = scheduler
            num_processes = count if num_processes is None else num_processes
            process_id = rank if process_id is None else process_id
        elif num_processes is not None and num_processes > 1:
            raise ValueError(
                f"num_processes={num_processes} but no process_id: pass it or set {ENV_PROCESS_ID}"
            )
    num_processes = 1 if num_processes is None else as_int(num_processes, "num_processes")
    process_id = 0 if process_id is None else as_int(process_id, "process_id")
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be at least 1")
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} is outside [0, {num_processes}) (source: {source})"
        )

    coordinator = coordinator_address or env_coordinator
    if coordinator is None and source == "SLURM":
        coordinator = _slurm_coordinator(env)
    if num_processes > 1:
        if coordinator is None:
            raise ValueError(
                f"{num_processes} processes (source: {source}) but no coordinator address: "
                f"pass coordinator_address='host:port' or set {ENV_COORDINATOR} to process 0's "
                "host and a free port"
            )
        if not re.fullmatch(r".+:\d+", coordinator):
            raise ValueError(f"coordinator address {coordinator!r} is not of the form host:port")
    return ProcessSettings(coordinator, num_processes, process_id, source)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    fail_fast: bool = True,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
    interface: str | None = None,
    coordinator_bind_address: str | None = None,
) -> ProcessSettings:
    """Joins this process to a multi-process JAX job (``jax.distributed``).

    Call it once per process, before any JAX computation or ``jax.devices()``.
    Settings come from the arguments or the environment, see
    :func:`resolve_settings`. A lone process (count 1) starts no coordinator
    and runs as plain single-process JAX, so one script serves both.

    Args:
      coordinator_address: ``host:port`` of process 0.
      num_processes: processes in the job.
      process_id: this process's id.
      local_device_count: CPU only: how many CPU devices this process exposes
        (``jax_num_cpu_devices``), to stand in for the GPUs of a host. GPUs
        are found by the runtime; restrict them with ``CUDA_VISIBLE_DEVICES``.
      fail_fast: in a job of several processes, make an uncaught exception
        end this process (exit code 1) right after its traceback is printed.
        Otherwise Python's exit waits in ``jax.distributed``'s shutdown barrier
        for ranks that may be blocked in a collective with this one, and the
        job hangs instead of failing; a launcher (``jaxcomm.launch``,
        ``srun --kill-on-bad-exit``, ``mpirun``) can only stop the others once
        this process has exited. ``sys.exit(code)`` still goes through the
        barrier. After the traceback, one line names this process and, when
        a cross-process collective lost its connection, says that another
        process has most likely died.
      heartbeat_timeout_s: seconds after which a process that sent no
        heartbeat (killed, frozen, its host gone) is declared dead; JAX then
        aborts every process of the job with a message naming it. Raise it
        for hosts that may stall longer than that and recover.
      interface: the network interface (``"eth1"``) or IP address of this host
        that CPU collectives (gloo) listen on, as PyTorch's
        ``GLOO_SOCKET_IFNAME``; by default ``JAXCOMM_SOCKET_IFNAME``, else
        gloo uses the address this host's name resolves to. Needed on hosts
        with several networks, or whose name resolves to 127.0.0.1. GPU
        collectives (NCCL) read ``NCCL_SOCKET_IFNAME`` instead.
      coordinator_bind_address: where process 0's coordination service (an
        unauthenticated key-value store) listens, ``host`` or ``host:port``;
        by default ``JAXCOMM_COORDINATOR_BIND_ADDRESS`` or
        ``JAX_COORDINATOR_BIND_ADDRESS``, else no wider than the coordinator
        address needs: a loopback coordinator (``python -m jaxcomm.launch``)
        binds loopback only, one that is an address of this host binds that
        address, and only a coordinator that cannot be told to be this
        host's binds every interface (see
        :func:`jaxcomm.distributed.network.resolve_bind_address`).

    Returns:
      The :class:`ProcessSettings` used.

    Raises:
      ValueError: missing or contradicting settings (see :func:`resolve_settings`),
        an ``interface`` this host does not have, or an ``interface`` with
        CPU collectives other than gloo.
      RuntimeError: called twice, or after JAX initialized its backends.
    """
    settings = resolve_settings(coordinator_address, num_processes, process_id)
    gloo_endpoint = network.resolve_interface(interface)
    if local_device_count is not None:
        if as_int(local_device_count, "local_device_count") < 1:
            raise ValueError(f"local_device_count={local_device_count} must be at least 1")
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    if settings.num_processes > 1:
        # jax 0.10.2 defaults to gloo; say so explicitly so a config that left
        # it unset (None) does not make cross-process CPU collectives fail.
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        collectives = jax.config.jax_cpu_collectives_implementation
        if gloo_endpoint is not None and collectives != "gloo":
            raise ValueError(
                f"interface {gloo_endpoint.interface or gloo_endpoint.address!r} chooses where "
                f"gloo listens, but CPU collectives are {collectives!r} "
                "(jax_cpu_collectives_implementation)"
            )
        bind_address = None  # only process 0 runs the coordination service
        if settings.process_id == 0:
            bind_address = network.resolve_bind_address(
                settings.coordinator_address, coordinator_bind_address
            )
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            cluster_detection_method="deactivate",
            heartbeat_timeout_seconds=as_int(heartbeat_timeout_s, "heartbeat_timeout_s"),
            coordinator_bind_address=bind_address,
        )
        if gloo_endpoint is not None:
            network.use_gloo_endpoint(gloo_endpoint)
        if fail_fast:
            sys.excepthook = _exit_after(sys.excepthook, settings)
    return settings


# How a collective (gloo) or the coordination service (gRPC) reports a peer
# that went away.
_LOST_PEER = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused", re.I)
# Process 0 hosts JAX's coordination service; once it exits, JAX aborts every
# other process at once. On an error it waits this long first, so that the
# others' own messages (often the same error) get out.
_COORDINATOR_LINGER_S = 1.0


def _exit_after(print_exception, settings: ProcessSettings):
    """An excepthook that prints as ``print_exception`` does, then exits at once."""

    def hook(exc_type, exc, traceback):
        code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
        try:
            print_exception(exc_type, exc, traceback)
            why = f"uncaught {exc_type.__name__}"
            if _LOST_PEER.search(str(exc)):
                why += (
                    ": lost the connection to another process of this job, which has most "
                    "likely died; its log says why"
                )
            print(
                f"jaxcomm.distributed: process {settings.process_id} of "
                f"{settings.num_processes} exits with code {code} ({why})",
                file=sys.stderr,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            if _jax_compat.distributed_state().service is not None:
                time.sleep(_COORDINATOR_LINGER_S)
        finally:
            os._exit(code)

    return hook
