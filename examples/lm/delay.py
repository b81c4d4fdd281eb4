"""Delay compensation for a one-step-stale gradient (DC-ASGD, Zheng et al. 2017).

With double buffering the optimizer at step t applies g(w_{t-1}), the
gradient taken at the previous parameters. DC-ASGD corrects it with a
diagonal outer-product approximation of the Hessian:
``g(w_t) ≈ g + λ g ⊙ g ⊙ (w_t - w_{t-1})``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax


class DelayCompensationState(NamedTuple):
    previous_params: optax.Params  # w_{t-1}; None before the first update


def delay_compensation(strength: float) -> optax.GradientTransformation:
    """Adds ``strength * g * g * (params - previous_params)`` to the gradient.

    Put it after the double-buffered ``allreduce_gradients`` and before the
    optimizer. Its state is the same on every device (``P()``).

    Args:
      strength: λ, >= 0 (0 leaves the gradient unchanged).
    """
    if not strength >= 0:
        raise ValueError(f"strength={strength} must be >= 0")

    def init_fn(params):
        return DelayCompensationState(previous_params=jax.tree.map(lambda p: p.copy(), params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("delay_compensation needs params")
        updates = jax.tree.map(
            lambda g, w, w_prev: g + strength * g * g * (w - w_prev),
            updates,
            params,
            state.previous_params,
        )
        return updates, DelayCompensationState(previous_params=params)

    return optax.GradientTransformation(init_fn, update_fn)
