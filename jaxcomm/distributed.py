"""Multi-process start-up: ``jax.distributed`` from the usual environment, and a
(process, local device) mesh for hierarchical allreduce.

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

When a process dies, the others end too, non-zero, in seconds
(``docs/faults.md``): a collective with it fails as soon as its TCP connection
closes, and JAX's coordination service aborts every process once the dead one
has missed heartbeats for ``heartbeat_timeout_s`` (30 s here, JAX's default is
100 s). :func:`check_same_settings` makes the processes compare their
settings once at start, and :func:`check_same_collectives` the collectives
their programs issue, which they would otherwise hang in when they differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import numbers
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

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

__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "ProcessSettings",
    "check_same_collectives",
    "check_same_settings",
    "collective_sequence",
    "first_slurm_host",
    "hierarchical_mesh",
    "initialize",
    "resolve_settings",
]


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


def _as_int(value, name: str) -> int:
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
    return _as_int(size, size_var), _as_int(rank, rank_var), source


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
        port = _as_int(env["SLURM_JOB_ID"], "SLURM_JOB_ID") % 2**12 + _SLURM_PORT_BASE
    return f"{first_slurm_host(nodelist)}:{_as_int(port, ENV_COORDINATOR_PORT)}"


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
    num_processes = 1 if num_processes is None else _as_int(num_processes, "num_processes")
    process_id = 0 if process_id is None else _as_int(process_id, "process_id")
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

    Returns:
      The :class:`ProcessSettings` used.

    Raises:
      ValueError: missing or contradicting settings (see :func:`resolve_settings`).
      RuntimeError: called twice, or after JAX initialized its backends.
    """
    settings = resolve_settings(coordinator_address, num_processes, process_id)
    if local_device_count is not None:
        if _as_int(local_device_count, "local_device_count") < 1:
            raise ValueError(f"local_device_count={local_device_count} must be at least 1")
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    if settings.num_processes > 1:
        # jax 0.10.2 defaults to gloo; say so explicitly so a config that left
        # it unset (None) does not make cross-process CPU collectives fail.
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            cluster_detection_method="deactivate",
            heartbeat_timeout_seconds=_as_int(heartbeat_timeout_s, "heartbeat_timeout_s"),
        )
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
            from jax._src.distributed import global_state

            if global_state.service is not None:
                time.sleep(_COORDINATOR_LINGER_S)
        finally:
            os._exit(code)

    return hook


_settings_checks = itertools.count()
_RUNTIME_KEYS = (
    "jax.__version__",
    "jaxcomm.__version__",
    "jax.default_backend()",
    "jax.local_device_count()",
)
# Always compared: processes that disagree on it would wait for ones that do not exist.
_COUNT_KEY = "jax.process_count()"


def _canonical(value) -> str:
    """A text for ``value`` that is equal in two processes iff the values are:
    dict keys and set elements sorted (a set's repr follows string hashing,
    which differs between processes)."""
    if isinstance(value, Mapping):
        items = sorted((str(k), _canonical(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in items) + "}"
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(_canonical(v) for v in value)) + "}"
    if isinstance(value, list | tuple):
        inner = ", ".join(_canonical(v) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    text = repr(value)
    if re.search(r" at 0x[0-9a-fA-F]+", text):
        raise TypeError(
            f"cannot compare {text} between processes: its repr holds a memory address; "
            "pass a plain value (str, number, tuple, dict) that stands for it"
        )
    return text


def _processes(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:8])) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
    return f"process{'es' if len(ids) > 1 else ''} {shown}"


def _differences(by_process: Mapping[int, Mapping[str, str]]) -> str | None:
    """Lines naming each key whose canonical value differs between processes,
    with the processes that hold each value; ``None`` if all agree."""
    lines = []
    for key in sorted({k for settings in by_process.values() for k in settings}):
        holders: dict[str, list[int]] = {}
        for process in sorted(by_process):
            holders.setdefault(by_process[process].get(key, "<not set>"), []).append(process)
        if len(holders) > 1:
            values = "; ".join(f"{value} on {_processes(ids)}" for value, ids in holders.items())
            lines.append(f"  {key}: {values}")
    return "\n".join(lines) or None


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """One meeting of all the processes of a job in the ``jax.distributed``
    key-value store, under keys that start with ``prefix``.

    Every process opens its exchanges of one kind in the same order, so that
    the n-th of each process meets the others' n-th (the prefix counts them).
    """

    client: Any
    process_id: int
    process_count: int
    prefix: str
    timeout_s: float
    deadline: float

    @classmethod
    def open(cls, kind: str, counter: itertools.count, timeout_s: float) -> _Exchange | None:
        """The next exchange of ``kind``; ``None`` in a lone process, which meets nobody."""
        from jax._src.distributed import global_state  # the client jax.distributed set up

        client = global_state.client
        if client is None or global_state.num_processes in (None, 1):
            return None
        prefix = f"jaxcomm/{kind}/{next(counter)}/"
        deadline = time.monotonic() + timeout_s
        return cls(
            client, global_state.process_id, global_state.num_processes, prefix, timeout_s, deadline
        )

    def _wait_ms(self) -> int:
        return max(1, int((self.deadline - time.monotonic()) * 1000))

    def publish(self, key: str, value: Any) -> None:
        self.client.key_value_set(self.prefix + key, json.dumps(value, sort_keys=True))

    def read(self, key: str) -> Any:
        """What another process published under ``key``, waited for until the deadline."""
        return json.loads(self.client.blocking_key_value_get(self.prefix + key, self._wait_ms()))

    def gather(
        self, own: Any, *, what: str, caller: str, stop: Callable[[Any], bool] | None = None
    ) -> tuple[dict[int, Any], bool]:
        """Publishes ``own`` and reads every other process's value.

        Args:
          own: this process's value, JSON-serializable.
          what: what the values are, for the timeout message.
          caller: the public function every process must call, for the same.
          stop: stops reading at the first value it is true for: the rest may
            not exist (processes that disagree on the process count).

        Returns:
          Value by process id, and whether it holds every process (``False``
          after ``stop``).

        Raises:
          TimeoutError: some processes published nothing by the deadline.
        """
        self.publish(str(self.process_id), own)
        by_process = {self.process_id: own}
        for process in range(self.process_count):
            if process == self.process_id:
                continue
            try:
                by_process[process] = self.read(str(process))
            except jax.errors.JaxRuntimeError as error:
                if "DEADLINE_EXCEEDED" not in str(error):
                    raise
                keys = (
                    key[len(self.prefix) :] for key, _ in self.client.key_value_dir_get(self.prefix)
                )
                published = {int(key) for key in keys if key.isdigit()}
                missing = [p for p in range(self.process_count) if p not in published]
                raise TimeoutError(
                    f"{_processes(missing)} did not publish {what} within {self.timeout_s} s; "
                    f"every process must call {caller} the same number of times"
                ) from None
            if stop is not None and stop(by_process[process]):
                return by_process, False
        return by_process, True

    def all_have_read(self) -> None:
        """Waits for every process to get here, so nobody raises before everyone
        has read: process 0 exiting takes the key-value store down with it."""
        self.client.wait_at_barrier(self.prefix + "read", self._wait_ms())


def check_same_settings(
    settings: Mapping[str, Any], *, runtime: bool = True, timeout_s: float = 300
) -> None:
    """Raises in every process if ``settings`` differ between the processes of the job.

    Call it once at start, after :func:`initialize`, with the same keys in every
    process: e.g. the command-line flags and the options given to jaxcomm's
    transforms. Processes that disagree on the wire dtype, the bucket size or
    the algorithm trace different collectives and then hang or compute
    garbage; this says which setting differs before the first step. Each
    process publishes its settings through the ``jax.distributed`` key-value
    store and reads everyone else's: a round trip and a barrier, no device
    work. With ``runtime=True`` it starts JAX's backends, as the first
    ``jax.devices()`` would. In a single process it only checks that the
    values can be compared.

    Values are compared by their ``repr``, with dict keys and set elements
    sorted; a value whose repr holds a memory address (a function, most
    objects) is refused, since it differs between processes anyway.

    Args:
      settings: name -> value: numbers, strings, dtypes, and tuples, lists,
        dicts or sets of them.
      runtime: also compare ``jax.__version__``, ``jaxcomm.__version__``,
        ``jax.default_backend()`` and ``jax.local_device_count()``. The
        process count (``jax.process_count()``) is always compared.
      timeout_s: how long to wait for the other processes' settings.

    Raises:
      ValueError: some settings differ; the message names each key and the
        processes that hold each value. Every process raises it.
      TimeoutError: some processes did not publish their settings within
        ``timeout_s`` (they never called this, or called it more often).
      TypeError: a value that cannot be compared.

    Examples:
      >>> check_same_settings({"wire_dtype": "bfloat16", "bucket_bytes": 2**22})
    """
    own = {str(key): _canonical(value) for key, value in settings.items()}
    clash = sorted(set(own) & {*_RUNTIME_KEYS, _COUNT_KEY})
    if clash:
        raise ValueError(f"settings {clash} are reserved for the ones check_same_settings adds")
    if runtime:
        import jaxcomm

        runtime_values = (
            jax.__version__,
            jaxcomm.__version__,
            jax.default_backend(),
            jax.local_device_count(),
        )
        own.update(zip(_RUNTIME_KEYS, map(_canonical, runtime_values), strict=True))
    exchange = _Exchange.open("same_settings", _settings_checks, timeout_s)
    if exchange is None:
        return
    own[_COUNT_KEY] = _canonical(exchange.process_count)
    by_process, complete = exchange.gather(
        own,
        what="settings",
        caller="check_same_settings",
        stop=lambda theirs: theirs.get(_COUNT_KEY) != own[_COUNT_KEY],
    )
    if complete:  # else some may not exist, and would never reach the barrier
        exchange.all_have_read()
    differences = _differences(by_process)
    if differences:
        raise ValueError(
            f"settings differ between the processes of this job (this is process "
            f"{exchange.process_id} of {exchange.process_count}):\n{differences}"
        )


# Collectives of a program, from its HLO before optimisation.

# HLO instructions that exchange data between devices.
_COLLECTIVE_OPCODES = frozenset(
    {
        "all-gather",
        "all-reduce",
        "all-to-all",
        "collective-broadcast",
        "collective-permute",
        "ragged-all-to-all",
        "reduce-scatter",
    }
)
# What a collective exchanges with whom. channel_id's number is left out, a
# numbering that rewrites may change; whether there is one is kept as "channel".
_EXCHANGE_ATTRIBUTES = (
    "dimensions",
    "replica_groups",
    "source_target_pairs",
    "use_global_device_ids",
)
# Custom calls that communicate: jaxcomm's FFI collectives.
_JAXCOMM_TARGET_PREFIX = "jaxcomm"
# Instructions whose attributes are read even when they call no computation.
_MAY_COMMUNICATE = _COLLECTIVE_OPCODES | {"custom-call"}
_INSTRUCTION = re.compile(
    r"\s*(?P<root>ROOT\s+)?%?[^\s=]+ = (?P<type>.*?) (?P<opcode>[a-z][a-z0-9-]*)\([^)]*\)"
    r"(?:, (?P<attributes>.*))?"
)
_COMPUTATION_HEADER = re.compile(r"(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)[^=]*\{\s*")
# Attributes that name the computations an instruction runs (call, while,
# conditional, fusion, reductions).
_CALLS = re.compile(
    r"\b(?:to_apply|body|condition|calls|true_computation|false_computation"
    r"|branch_computations|called_computations)="
)
_SINGLE_CALLS = ("to_apply", "body", "condition", "calls", "true_computation", "false_computation")
_MULTIPLE_CALLS = ("branch_computations", "called_computations")


def _hlo_attributes(text: str) -> dict[str, str]:
    """The ``key=value`` attributes of an HLO instruction: split at the commas
    outside brackets and strings (replica groups and configs hold commas)."""
    pieces, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, char in enumerate(text):
        if quoted:
            escaped, quoted = char == "\\" and not escaped, quoted and (char != '"' or escaped)
        elif char == '"':
            quoted = True
        elif char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
        elif char == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    return dict(piece.strip().partition("=")[::2] for piece in pieces if piece.strip())


def _hlo_computations(text: str) -> tuple[dict[str, list[re.Match]], str]:
    """Instructions by computation name, and the name of the entry computation."""
    computations: dict[str, list[re.Match]] = {}
    entry, instructions = None, None
    for line in text.splitlines():
        if instructions is None:
            header = _COMPUTATION_HEADER.fullmatch(line)
            if header and not line.startswith("HloModule"):
                instructions = computations.setdefault(header["name"], [])
                entry = header["name"] if header["entry"] else entry
        elif line.strip() == "}":
            instructions = None
        elif instruction := _INSTRUCTION.fullmatch(line):
            instructions.append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def _called(attributes: Mapping[str, str]) -> list[str]:
    names = [attributes[key] for key in _SINGLE_CALLS if key in attributes]
    for key in _MULTIPLE_CALLS:
        names += re.findall(r"[^\s{},%]+", attributes.get(key, ""))
    return [name.lstrip("%") for name in names]


def _reduction(computation: list[re.Match]) -> str:
    """The opcode at the root of a reduction computation: add, maximum, ..."""
    return next((i["opcode"] for i in computation if i["root"]), "?")


def _signature(
    instruction: re.Match, attributes: Mapping[str, str], computations: Mapping[str, list]
) -> str | None:
    """One line for a collective, equal in two processes when they issue the
    same collective; ``None`` for an instruction that does not communicate."""
    opcode = instruction["opcode"]
    # The result type without layouts: f32[8]{0} -> f32[8].
    parts = [re.sub(r"\{[^{}]*\}", "", instruction["type"])]
    if opcode == "custom-call":
        target = attributes.get("custom_call_target", "").strip('"')
        if not target.startswith(_JAXCOMM_TARGET_PREFIX):
            return None
        # {algorithm = 2 : i32, op_id = 1 : i64} -> {algorithm=2, op_id=1}; op_id is the
        # call site, which picks the NCCL communicator on GPU, so it must agree too.
        config = attributes.get("backend_config", "")
        return " ".join([target, *parts, re.sub(r" : \w+", "", config).replace(" = ", "=")])
    if opcode not in _COLLECTIVE_OPCODES:
        return None
    if "to_apply" in attributes:
        opcode += f"({_reduction(computations.get(attributes['to_apply'].lstrip('%'), []))})"
    if "channel_id" in attributes:
        parts.append("channel")
    parts += [f"{key}={attributes[key]}" for key in _EXCHANGE_ATTRIBUTES if key in attributes]
    return " ".join([opcode, *parts])


def collective_sequence(lowered: jax.stages.Lowered | str) -> list[str]:
    """The collectives of a lowered program, one line each, in the order its HLO lists them.

    Reads the HLO before optimisation (``lowered.as_text(dialect="hlo")``), so
    nothing is compiled. It lists the instructions that communicate
    (all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all,
    collective-broadcast, ragged-all-to-all) and custom calls whose target
    starts with ``jaxcomm`` (the ``backend="ffi"`` collectives), in the order
    of the HLO text, with the collectives of called computations (loop
    bodies, both branches of a conditional, calls) where they are called.
    That order follows the data flow, which XLA schedules from: the same
    program gives the same list in every process, and one whose collectives
    run in another order (a pytree flattened in another order) another list. A line holds the opcode
    (with the reduction, e.g. ``all-reduce(add)``) or custom-call target, the
    result type, and what says who exchanges with whom: replica groups,
    source-target pairs, dimensions, whether it has a channel; for jaxcomm's
    calls, their options, including the call-site id (``op_id``). Instruction
    names and channel numbers, which may differ between processes for the
    same program, are left out.

    Collectives that XLA's partitioner adds during compilation (``jax.jit``
    with sharded arguments and no ``shard_map``) are not in this HLO yet, so
    they are not listed.

    Args:
      lowered: ``jax.jit(f).lower(*args)``, or the text of its
        ``as_text(dialect="hlo")``.

    Returns:
      One line per collective.

    Examples:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("batch",))
      >>> total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "batch"), mesh=mesh,
      ...                               in_specs=P("batch"), out_specs=P()))
      >>> x = jax.device_put(np.ones(16, np.float32), NamedSharding(mesh, P("batch")))
      >>> collective_sequence(total.lower(x))  # doctest: +NORMALIZE_WHITESPACE
      ['all-reduce(add) f32[2] channel replica_groups={{0,1,2,3,4,5,6,7}}
        use_global_device_ids=true']
    """
    text = lowered if isinstance(lowered, str) else lowered.as_text(dialect="hlo")
    computations, entry = _hlo_computations(text)
    issued: dict[str, list[str]] = {}  # by computation, each read once

    def walk(name: str) -> list[str]:
        if name not in issued:
            sequence = []
            for instruction in computations.get(name, []):
                rest = instruction["attributes"] or ""
                if instruction["opcode"] not in _MAY_COMMUNICATE and not _CALLS.search(rest):
                    continue
                attributes = _hlo_attributes(rest)
                signature = _signature(instruction, attributes, computations)
                if signature is not None:
                    sequence.append(signature)
                else:
                    for called in _called(attributes):
                        sequence += walk(called)
            issued[name] = sequence
        return issued[name]

    return list(walk(entry))


_collective_checks = itertools.count()
_CONTEXT = 2  # collectives shown on each side of the first difference
_SHOWN_CHARS = 240  # longer lines (replica groups of big meshes) lose their middle


def _shorten(line: str) -> str:
    if len(line) <= _SHOWN_CHARS:
        return line
    return f"{line[: _SHOWN_CHARS - 80]} ... {line[-75:]}"


def _sequence_differences(by_holders: Mapping[tuple[int, ...], list[str]]) -> str:
    """Lines naming the first position where the sequences differ, what each
    group of processes has there, the lengths, and a few collectives around it."""

    def holders_of(values: Mapping[tuple[int, ...], Any]) -> list[str]:
        ids: dict[Any, list[int]] = {}
        for holders, value in values.items():
            ids.setdefault(value, []).extend(holders)
        return [f"{value} on {_processes(sorted(p))}" for value, p in ids.items()]

    sequences = list(by_holders.values())
    shortest = min(map(len, sequences))
    first = next((i for i in range(shortest) if len({s[i] for s in sequences}) > 1), shortest)
    here = {
        holders: _shorten(seq[first]) if first < len(seq) else f"nothing (it issues {len(seq)})"
        for holders, seq in by_holders.items()
    }
    lines = [f"  first difference at collective {first} (counting from 0):"]
    lines += [f"    {entry}" for entry in holders_of(here)]
    lengths = holders_of({holders: len(seq) for holders, seq in by_holders.items()})
    lines.append(f"  collectives in all: {'; '.join(lengths)}")
    for holders, sequence in by_holders.items():
        start, stop = max(0, first - _CONTEXT), min(len(sequence), first + _CONTEXT + 1)
        if start == stop:
            lines.append(f"  {_processes(list(holders))}: no collectives")
            continue
        lines.append(f"  {_processes(list(holders))}, collectives {start}-{stop - 1}:")
        lines += [
            f"    {'>' if i == first else ' '} {i}: {_shorten(sequence[i])}"
            for i in range(start, stop)
        ]
    return "\n".join(lines)


def _lowered(step, args: tuple, kwargs: dict) -> jax.stages.Lowered:
    if isinstance(step, jax.stages.Lowered):
        if args or kwargs:
            raise TypeError("a Lowered step takes no arguments: they were given to lower()")
        return step
    if isinstance(step, jax.stages.Compiled):
        raise TypeError(
            "pass the Lowered step (jax.jit(step).lower(*args)), not its compile(): "
            "check_same_collectives reads the program before optimisation"
        )
    if not callable(step):
        raise TypeError(
            f"step must be a function, a jitted function or a jax.stages.Lowered, "
            f"not {type(step).__name__}"
        )
    lower = getattr(step, "lower", None) or jax.jit(step).lower
    return lower(*args, **kwargs)


def check_same_collectives(step, /, *args, timeout_s: float = 300, **kwargs) -> list[str]:
    """Raises in every process if the processes' programs issue different collectives.

    Every process traces its own program. If the programs differ (pytrees in
    another order, a flag that changes bucketing, a branch taken in one
    process only), their collectives run in another order or with other
    shapes, and gloo or NCCL then hang or fail obscurely. Call this once at
    start, after :func:`initialize` (and :func:`check_same_settings`), with
    the step and its first arguments: each process lowers the step (it traces,
    it does not compile), lists its collectives with
    :func:`collective_sequence`, and compares the list with the other
    processes' through the ``jax.distributed`` key-value store. Each process
    publishes a digest; only if they differ does one process of each group
    publish its list, so that every process can say where they part. In a
    single process it returns the list, with nothing to compare.

    Collectives that XLA's partitioner inserts during compilation are not
    compared (see :func:`collective_sequence`): this covers ``shard_map``,
    ``pmap`` and jaxcomm's collectives and transforms.

    Args:
      step: a function, a jitted function (``jax.jit(step)``, called as
        ``step.lower(*args, **kwargs)``), or an already lowered one
        (``jax.jit(step).lower(*args)``, then no ``args``).
      *args: example arguments: arrays, or ``jax.ShapeDtypeStruct`` with
        shardings.
      timeout_s: how long to wait for the other processes.
      **kwargs: keyword arguments of ``step`` (none may be called ``timeout_s``).

    Returns:
      This process's collectives, one line each (see :func:`collective_sequence`).

    Raises:
      ValueError: the collectives differ; every process raises it, naming the
        first position where they differ, what each process has there, the
        number of collectives of each, and a few collectives around the
        difference. Also a process count that differs.
      TimeoutError: some processes did not publish within ``timeout_s``
        (they never called this, or called it more often).
      TypeError: ``step`` is not a function or a ``Lowered``, or is a
        ``Lowered`` given arguments.

    Examples:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("batch",))
      >>> @jax.jit
      ... @jax.shard_map(mesh=mesh, in_specs=P("batch"), out_specs=P())
      ... def mean_norm(x):
      ...     return jax.lax.pmean(jax.numpy.sum(x * x), "batch")
      >>> x = jax.device_put(np.ones(16, np.float32), NamedSharding(mesh, P("batch")))
      >>> collectives = check_same_collectives(mean_norm, x)  # one process: nothing to compare
      >>> [line.split()[:2] for line in collectives]
      [['all-reduce(add)', 'f32[]']]
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    sequence = collective_sequence(_lowered(step, args, kwargs))
    exchange = _Exchange.open("same_collectives", _collective_checks, timeout_s)
    if exchange is None:
        return sequence
    me, count = exchange.process_id, exchange.process_count
    digest = hashlib.sha256(json.dumps(sequence).encode()).hexdigest()
    summaries, complete = exchange.gather(
        {"processes": count, "sha256": digest},
        what="collectives",
        caller="check_same_collectives",
        stop=lambda theirs: theirs["processes"] != count,
    )
    if not complete:
        counts = {p: {_COUNT_KEY: _canonical(s["processes"])} for p, s in summaries.items()}
        raise ValueError(
            f"the process count differs between the processes of this job (this is process "
            f"{me} of {count}):\n{_differences(counts)}"
        )
    groups: dict[str, list[int]] = {}
    for process in sorted(summaries):
        groups.setdefault(summaries[process]["sha256"], []).append(process)
    by_holders = {}
    if len(groups) > 1:
        # Lists go through process 0's key-value store: one per group, not one per process.
        if groups[digest][0] == me:
            exchange.publish(f"sequence/{me}", sequence)
        for holders in groups.values():
            own = me in holders
            by_holders[tuple(holders)] = (
                sequence if own else exchange.read(f"sequence/{holders[0]}")
            )
    exchange.all_have_read()
    if by_holders:
        raise ValueError(
            f"collectives differ between the processes of this job (this is process {me} of "
            f"{count}):\n{_sequence_differences(by_holders)}"
        )
    return sequence


def hierarchical_mesh(
    inter_axis: str = "node", intra_axis: str = "local", *, nodes: int | None = None
) -> Mesh:
    """A 2-D mesh: processes along ``inter_axis``, their local devices along ``intra_axis``.

    Row i holds the devices of node i, process by process and by device id
    inside a process, so
    ``allreduce(..., (inter_axis, intra_axis), algorithm="hierarchical")``
    reduces inside each node first and only 1/L of the data crosses nodes.
    Flattened in row-major order the devices run process by process, which is
    the order ``PartitionSpec((inter_axis, intra_axis))`` shards a batch in.

    Args:
      inter_axis: name of the axis across nodes.
      intra_axis: name of the axis inside a node.
      nodes: rows of the mesh; ``jax.process_count()`` by default (one node per
        process). A multiple of the process count splits each process's
        devices into several rows: one process of 8 devices with ``nodes=2``
        has the shape of 2 processes x 4 devices. A divisor of it groups
        consecutive processes into one row: with one process per GPU, 4 GPUs a
        host and ranks numbered host by host (SLURM's default block
        distribution), ``nodes=jax.process_count() // 4`` puts each host's
        GPUs on ``intra_axis``.

    Returns:
      A ``jax.sharding.Mesh`` of shape ``(nodes, devices // nodes)``.

    Raises:
      ValueError: processes with different device counts, or ``nodes`` that
        would split a process's devices unevenly or across rows.

    Examples:
      >>> mesh = hierarchical_mesh(nodes=2)  # one process, 8 CPU devices
      >>> dict(mesh.shape)
      {'node': 2, 'local': 4}
    """
    processes = jax.process_count()
    nodes = processes if nodes is None else _as_int(nodes, "nodes")
    by_process = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    counts = {p: len(ds) for p, ds in by_process.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"processes hold different numbers of devices: {counts}")
    per_process = next(iter(counts.values()))
    splits = nodes >= processes and nodes % processes == 0 and per_process % (nodes // processes)
    if nodes < 1 or (nodes % processes and processes % nodes) or splits:
        raise ValueError(
            f"nodes={nodes} does not fit {processes} processes of {per_process} devices: "
            "it must divide the process count, or be a multiple of it that divides "
            "each process's devices evenly"
        )
    ordered = [d for p in sorted(by_process) for d in sorted(by_process[p], key=lambda d: d.id)]
    grid = np.array(ordered, dtype=object).reshape(nodes, len(ordered) // nodes)
    return Mesh(grid, (inter_axis, intra_axis))
