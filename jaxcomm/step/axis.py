"""The data axis of the step being traced.

:func:`jaxcomm.data_parallel` sets it while it traces a step, so that
:func:`jaxcomm.value_and_grad` and :func:`jaxcomm.grad` inside the step need no
``axis_name``. A context variable rather than an argument: the user's step,
not jaxcomm, calls ``value_and_grad``.
"""

from __future__ import annotations

import contextlib
import contextvars

_STEP_AXIS: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_step_axis", default=None)


def current_axis():
    """The data axis of the :func:`jaxcomm.data_parallel` step being traced, or None."""
    return _STEP_AXIS.get()


@contextlib.contextmanager
def step_axis(axis_name):
    """Makes `axis_name` the current step's data axis inside the block."""
    token = _STEP_AXIS.set(axis_name)
    try:
        yield
    finally:
        _STEP_AXIS.reset(token)
