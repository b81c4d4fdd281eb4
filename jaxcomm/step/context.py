"""What :func:`jaxcomm.data_parallel` tells the gradient functions about the step it traces.

Three facts, set while the step is traced: its data axis (so that
:func:`jaxcomm.value_and_grad` and :func:`jaxcomm.grad` need no ``axis_name``);
the optimizer states among its arguments that keep each device's own params
(``diloco``, ``double_buffered``), at which those functions then take the
gradient, as the transforms require; and how each argument array is split over
the mesh's other (Auto) axes, which the traced values do not say and the
transforms need to run on each device's shards (:func:`placement`). Context
variables rather than arguments: the user's step, not jaxcomm, calls
``value_and_grad`` and ``optimizer.update``.
"""

from __future__ import annotations

import contextlib
import contextvars

_STEP_AXIS: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_step_axis", default=None)
_AT_LOCAL: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_at_local", default=())
_PLACED: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_placed", default=None)


def current_axis():
    """The data axis of the :func:`jaxcomm.data_parallel` step being traced, or None."""
    return _STEP_AXIS.get()


def local_params_states() -> tuple:
    """The optimizer states of the step being traced that keep each device's
    params (a ``LocalParams`` field), or (): read when asked, so a step that
    updates its optimizer and differentiates again sees the new ones."""
    return tuple(optimizer.opt_state for optimizer in _AT_LOCAL.get())


def placement(x):
    """The PartitionSpec over the mesh's Auto axes that the step's argument
    array `x` (a traced value, as the step received it) is placed with, or
    None for any other value or outside a step."""
    placed = _PLACED.get()
    found = placed.get(id(x)) if placed else None
    return found[1] if found is not None and found[0] is x else None


@contextlib.contextmanager
def step_context(axis_name, at_local: tuple = (), placed=()):
    """Inside the block, `axis_name` is the step's data axis, `at_local` the
    optimizers (objects with an ``opt_state``) that keep each device's params,
    and `placed` pairs (traced argument, its spec over the Auto axes)."""
    table = {id(x): (x, spec) for x, spec in placed}  # x kept alive: ids stay unique
    tokens = (_STEP_AXIS.set(axis_name), _AT_LOCAL.set(tuple(at_local)), _PLACED.set(table))
    try:
        yield
    finally:
        _STEP_AXIS.reset(tokens[0])
        _AT_LOCAL.reset(tokens[1])
        _PLACED.reset(tokens[2])
