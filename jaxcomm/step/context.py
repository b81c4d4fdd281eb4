"""What :func:`jaxcomm.data_parallel` tells the gradient functions about the step it traces.

Two facts, set while the step is traced: its data axis (so that
:func:`jaxcomm.value_and_grad` and :func:`jaxcomm.grad` need no ``axis_name``),
and the optimizer states among its arguments that keep each device's own
params (``diloco``, ``double_buffered``), at which those functions then take the
gradient, as the transforms require. Context variables rather than arguments:
the user's step, not jaxcomm, calls ``value_and_grad``.
"""

from __future__ import annotations

import contextlib
import contextvars

_STEP_AXIS: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_step_axis", default=None)
_AT_LOCAL: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_at_local", default=())


def current_axis():
    """The data axis of the :func:`jaxcomm.data_parallel` step being traced, or None."""
    return _STEP_AXIS.get()


def local_params_states() -> tuple:
    """The optimizer states of the step being traced that keep each device's
    params (a ``LocalParams`` field), or (): read when asked, so a step that
    updates its optimizer and differentiates again sees the new ones."""
    return tuple(optimizer.opt_state for optimizer in _AT_LOCAL.get())


@contextlib.contextmanager
def step_context(axis_name, at_local: tuple = ()):
    """Inside the block, `axis_name` is the step's data axis and `at_local`
    the optimizers (objects with an ``opt_state``) that keep each device's
    params."""
    tokens = (_STEP_AXIS.set(axis_name), _AT_LOCAL.set(tuple(at_local)))
    try:
        yield
    finally:
        _STEP_AXIS.reset(tokens[0])
        _AT_LOCAL.reset(tokens[1])
