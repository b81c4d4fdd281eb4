"""Collectives over a sharded model's shards, not over the data-parallel axes.

A param sharded over model axes ("fsdp") is held in pieces, one per device
of those axes; a transform that needs a whole-param quantity (a matrix
product's sum, an orthonormal basis of all its rows, a loss statistic every
shard agrees on) combines the pieces with these. They are XLA's own
collectives: the data-parallel exchange, with its wire and backend, is
:class:`jaxcomm.collectives.BoundReduction`'s.
"""

from __future__ import annotations

import jax

__all__ = ["all_gather", "any_true", "pmean", "psum"]


def psum(x, axes: tuple):
    """`x` summed over the shard axes `axes` (``x`` itself for none)."""
    return jax.lax.psum(x, axes) if axes else x


def pmean(x, axes: tuple):
    """`x` averaged over the shard axes `axes` (``x`` itself for none)."""
    return jax.lax.pmean(x, axes) if axes else x


def any_true(flag, axes: tuple):
    """Bool `flag`, true wherever it is true on one device of `axes`."""
    if not axes:
        return flag
    return jax.lax.pmax(flag.astype("int32"), axes) > 0


def all_gather(x, axes: tuple):
    """The pieces of `x` over `axes` put back together along its axis 0, in
    the axes' order (``x`` itself for none)."""
    return jax.lax.all_gather(x, axes, axis=0, tiled=True) if axes else x
