"""Making a collective schedule differentiable the way lax.psum is."""

from __future__ import annotations

import jax
from jax import lax

from jaxcomm.collectives._axes import is_vma_typed, normalize


def linear_collective(forward, x, axes: tuple, scale: float, backward_allreduce):
    """forward(x), differentiated the way lax.psum is in the same context.

    forward is the linear map y = scale * sum_devices(x) (up to wire
    rounding). Its transpose is, like psum's, a pvary times scale in
    vma-typed shard_map, and the same allreduce elsewhere. `x` may be a
    tuple of arrays reduced together (a bucket's parts).
    """
    axes = normalize(axes)
    vma = is_vma_typed(jax.tree.leaves(x)[0], axes)

    @jax.custom_vjp
    def f(v):
        return forward(v)

    def fwd(v):
        return forward(v), None

    def scaled(ct):
        if not is_vma_typed(ct, axes):  # a result typed as replicated
            ct = lax.pcast(ct, axes, to="varying")
        return (ct * scale).astype(ct.dtype) if scale != 1.0 else ct

    def bwd(_, ct):
        if vma:
            return (jax.tree.map(scaled, ct),)
        return (backward_allreduce(ct),)

    f.defvjp(fwd, bwd)
    return f(x)
