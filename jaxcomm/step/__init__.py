"""The training step: what runs a step per device and takes each device's gradient.

Below the transforms: a step wrapper (:func:`data_parallel`, a replacement for
``jit``), the gradient functions that leave the reduction to a jaxcomm
transform (:func:`value_and_grad`, :func:`grad`, :func:`local_value_and_grad`,
:func:`local_grad`), and the data axis of the step being traced
(:func:`current_axis`) and the optimizer states that keep each device's params
(:func:`local_params_states`) and how its arguments are split over the other
mesh axes (:func:`placement`), which tie them together.
"""

from jaxcomm.step.context import current_axis, local_params_states, placement
from jaxcomm.step.data_parallel import data_parallel
from jaxcomm.step.grad import grad, value_and_grad
from jaxcomm.step.local_grad import local_grad, local_value_and_grad

__all__ = [
    "current_axis",
    "data_parallel",
    "grad",
    "local_grad",
    "local_params_states",
    "local_value_and_grad",
    "placement",
    "value_and_grad",
]
