"""Meetings of all the processes of a job in the ``jax.distributed`` key-value store.

Process 0 hosts the store (JAX's coordination service); every process reaches
it through the client that ``jax.distributed.initialize`` made. An
:class:`Exchange` is one meeting under its own key prefix: each process
publishes JSON values, reads the others' with one deadline for the whole
meeting, and can wait until all have read. The agreement checks
(:func:`jaxcomm.distributed.check_same_settings`, ``check_same_collectives``)
and the NCCL id sharing of the ``ffi`` collectives meet through it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxcomm import _jax_compat

__all__ = ["Exchange", "name_processes"]


def name_processes(ids: list[int]) -> str:
    """Processes by id for a message, the first 8 of a long list.

    Examples:
      >>> name_processes([3])
      'process 3'
      >>> name_processes(list(range(10)))
      'processes 0, 1, 2, 3, 4, 5, 6, 7, ... (10 in all)'
    """
    shown = ", ".join(map(str, ids[:8])) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
    return f"process{'es' if len(ids) > 1 else ''} {shown}"


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One meeting of all the processes of a job in the ``jax.distributed``
    key-value store, under keys that start with ``prefix``.

    Every process opens the same meetings in the same order with the same
    names, so that each meets the others' (a name holds a count or a call-site
    id for meetings of one kind).
    """

    client: Any
    process_id: int
    process_count: int
    prefix: str
    timeout_s: float
    deadline: float

    @classmethod
    def open(cls, name: str, timeout_s: float) -> Exchange | None:
        """The meeting ``name`` (keys under ``jaxcomm/<name>/``), whose reads
        wait at most ``timeout_s`` in all; ``None`` in a lone process, which
        meets nobody, or before ``jax.distributed.initialize``."""
        state = _jax_compat.distributed_state()
        client = state.client
        if client is None or state.num_processes in (None, 1):
            return None
        deadline = time.monotonic() + timeout_s
        return cls(
            client,
            state.process_id,
            state.num_processes,
            f"jaxcomm/{name}/",
            timeout_s,
            deadline,
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
                    f"{name_processes(missing)} did not publish {what} within "
                    f"{self.timeout_s} s; every process must call {caller} the same number "
                    "of times"
                ) from None
            if stop is not None and stop(by_process[process]):
                return by_process, False
        return by_process, True

    def all_have_read(self) -> None:
        """Waits for every process to get here, so nobody raises before everyone
        has read: process 0 exiting takes the key-value store down with it."""
        self.client.wait_at_barrier(self.prefix + "read", self._wait_ms())
