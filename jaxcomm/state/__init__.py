"""What jaxcomm keeps between steps, below the step wrapper and the transforms.

- :mod:`jaxcomm.state.per_device`: :class:`PerDevice` (and :class:`LocalParams`),
  the subtrees that hold one row per device, their construction and placement;
  the mark is the type's own field name, so it survives containers that drop
  types (Flax NNX state).
- :mod:`jaxcomm.state.comm_stats`: :class:`CommStats`, what a step communicated,
  and :func:`get_stats`, which finds it in any optimizer state.
- :mod:`jaxcomm.state.local_params`: :func:`local_params`, the params a device
  takes its gradient at, read out of any state that keeps them.
- :mod:`jaxcomm.state.specs`: :func:`state_specs`, the PartitionSpecs an optimizer
  state enters ``shard_map`` with, and the refusal of optax wrappers that break
  a jaxcomm transform.
"""

from jaxcomm.state.comm_stats import CommStats, get_stats
from jaxcomm.state.local_params import holds_local_params, local_params
from jaxcomm.state.per_device import LocalParams, PerDevice, placed_spec, spec_axes
from jaxcomm.state.specs import is_nnx_object, state_specs

__all__ = [
    "CommStats",
    "LocalParams",
    "PerDevice",
    "get_stats",
    "holds_local_params",
    "is_nnx_object",
    "local_params",
    "placed_spec",
    "spec_axes",
    "state_specs",
]
