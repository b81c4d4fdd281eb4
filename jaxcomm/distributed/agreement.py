"""Checks that every process of a job agrees before the first step.

:func:`check_same_settings` compares settings (flags, transform options, the
runtime's versions and device counts), :func:`check_same_collectives` the
collectives each process's step will issue. Both meet through an
:class:`~jaxcomm.distributed.exchange.Exchange`, and every process raises
the same error naming what differs and where.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import numbers
import re
from collections.abc import Mapping
from typing import Any

import jax

from jaxcomm.distributed.exchange import Exchange, name_processes
from jaxcomm.distributed.hlo import collective_sequence

__all__ = ["check_same_collectives", "check_same_settings"]

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


def _differences(by_process: Mapping[int, Mapping[str, str]]) -> str | None:
    """Lines naming each key whose canonical value differs between processes,
    with the processes that hold each value; ``None`` if all agree."""
    lines = []
    for key in sorted({k for settings in by_process.values() for k in settings}):
        holders: dict[str, list[int]] = {}
        for process in sorted(by_process):
            holders.setdefault(by_process[process].get(key, "<not set>"), []).append(process)
        if len(holders) > 1:
            values = "; ".join(
                f"{value} on {name_processes(ids)}" for value, ids in holders.items()
            )
            lines.append(f"  {key}: {values}")
    return "\n".join(lines) or None


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
    exchange = Exchange.open(f"same_settings/{next(_settings_checks)}", timeout_s)
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
        return [f"{value} on {name_processes(sorted(p))}" for value, p in ids.items()]

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
            lines.append(f"  {name_processes(list(holders))}: no collectives")
            continue
        lines.append(f"  {name_processes(list(holders))}, collectives {start}-{stop - 1}:")
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
    exchange = Exchange.open(f"same_collectives/{next(_collective_checks)}", timeout_s)
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
