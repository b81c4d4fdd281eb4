"""Multi-process jobs: start-up, agreement checks, and meshes across processes.

- :mod:`~jaxcomm.distributed.startup`: :func:`initialize` joins a process to a
  ``jax.distributed`` job from its arguments or the launcher, SLURM or Open MPI
  variables (:func:`resolve_settings` finds them without starting anything).
- :mod:`~jaxcomm.distributed.network`: the interface gloo listens on, and
  the address process 0's coordination service binds.
- :mod:`~jaxcomm.distributed.exchange`: meetings of all processes in the
  ``jax.distributed`` key-value store.
- :mod:`~jaxcomm.distributed.agreement`: :func:`check_same_settings` and
  :func:`check_same_collectives` stop a job whose processes disagree before
  the first step.
- :mod:`~jaxcomm.distributed.hlo`: :func:`collective_sequence` lists the
  collectives of a lowered program.
- :mod:`~jaxcomm.distributed.mesh`: :func:`hierarchical_mesh`, processes by
  local devices.
"""

from jaxcomm.distributed.agreement import check_same_collectives, check_same_settings
from jaxcomm.distributed.hlo import collective_sequence
from jaxcomm.distributed.mesh import hierarchical_mesh
from jaxcomm.distributed.startup import (
    ENV_COORDINATOR,
    ENV_COORDINATOR_PORT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    HEARTBEAT_TIMEOUT_S,
    JAX_ENV_COORDINATOR,
    ProcessSettings,
    first_slurm_host,
    initialize,
    resolve_settings,
)

__all__ = [
    "ENV_COORDINATOR",
    "ENV_COORDINATOR_PORT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "HEARTBEAT_TIMEOUT_S",
    "JAX_ENV_COORDINATOR",
    "ProcessSettings",
    "check_same_collectives",
    "check_same_settings",
    "collective_sequence",
    "first_slurm_host",
    "hierarchical_mesh",
    "initialize",
    "resolve_settings",
]
