"""Chunk-sparse's local passes over its flat pool, after the exchange.

Two per step: each chunk's L1 norm (the score the next mask ranks by) and
the residual kept for the next step. With jaxcomm's CPU handlers each is
one custom call that reads only the chunks it needs (the exchanged pool
where a chunk was sent, the local one elsewhere); elsewhere XLA computes
the same from both pools whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm.collectives import _ffi
from jaxcomm.collectives.varying import to_varying


def elements(mask, chunk_size: int, size: int):
    """Each chunk's flag over its elements, for a pool of `size` elements. A
    broadcast, which XLA fuses into what reads it; jnp.repeat builds the
    same with a scatter and a prefix sum over the whole pool."""
    return jnp.broadcast_to(mask[:, None], (mask.shape[0], chunk_size)).reshape(-1)[:size]


def l1(local, exchanged, mask, *, chunk_size: int, axes, cpu_ffi: bool):
    """float32[chunks]: the L1 norm of each chunk of `exchanged` where `mask`
    selects it, of `local` elsewhere (flat pools of one length)."""
    if cpu_ffi:
        return _ffi.chunk_l1(
            local, to_varying(exchanged, axes), to_varying(mask, axes), chunk_size=chunk_size
        )
    sent, kept = _two_l1(exchanged, local, nchunks=mask.shape[0], chunk_size=chunk_size)
    return jnp.where(mask, sent, kept)


def residual(local, mask, *, chunk_size: int, decay: float, skip, old, axes, cpu_ffi: bool):
    """`decay * local` on the chunks `mask` leaves out and zeros on the
    others, in local's dtype; `old` where `skip` is set. Shaped like `old`
    (the state's row: local's elements, any shape), whose buffer the CPU
    call writes in place."""
    if cpu_ffi:
        return _ffi.chunk_residual(
            local,
            to_varying(mask, axes),
            to_varying(skip, axes),
            old,
            chunk_size=chunk_size,
            decay=decay,
        )
    sent = elements(mask, chunk_size, local.size)
    new = (decay * jnp.where(sent, jnp.zeros((), local.dtype), local)).astype(local.dtype)
    return jnp.where(skip, old, new.reshape(old.shape))


def _two_l1(*pools, nchunks: int, chunk_size: int):
    """The float32 L1 norm of every chunk of each pool, in one reduction.

    One variadic reduction reads the pools once and writes nothing else:
    XLA CPU gives a plain sum to a library kernel that first copies its
    padded input (a whole pool of fresh memory per sum, and 4x the time).
    """

    def chunks(pool):
        a = jnp.abs(pool.astype(jnp.float32))
        return jnp.pad(a, (0, nchunks * chunk_size - a.size)).reshape(nchunks, chunk_size)

    zeros = tuple(jnp.float32(0) for _ in pools)
    return jax.lax.reduce(
        tuple(chunks(p) for p in pools),
        zeros,
        lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)),
        (1,),
    )
