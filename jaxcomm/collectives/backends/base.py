"""Backend: the operations a bound reduction asks of an implementation.

One class per implementation (XLA's collectives, jaxcomm's CPU custom calls,
its CUDA ones), one driver (_allreduce.py and BoundReduction, which keep the
semantics: checks, scales, bytes, cast error). The model is nccl-tests'
table of functions per collective: adding a backend or a schedule is one
new class, and no code outside the backend classes asks which platform it
runs on.

Every collective takes a flat 1-D array of a checked dtype, reduced over
``bound.place`` (N > 1: the one-device case never reaches a backend), and
follows one contract: ``cast(x * prescale)`` travels, the reduced value is
multiplied by ``postscale`` and cast back (``bound.scales``). The local
passes around chunk-sparse's exchange have XLA's own code here, which a
backend may replace with faster calls of its own.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxcomm import _flat


class Backend:
    """Where and how a reduction's collectives run.

    Attributes:
      name: what ``BoundReduction.backend`` reports (``"xla"`` or ``"ffi"``
        for jaxcomm's own; a backend of your own may name itself).
      algorithms: the ``algorithm=`` values it takes (``"auto"`` included).
      sends_only_selected: a masked allreduce sends exactly the selected
        chunks, with no static bound (``max_chunks`` is then only a hint).
      default_bucket_bytes: the fusion threshold when a transform gives none.
    """

    name: ClassVar[str] = "custom"
    algorithms: ClassVar[tuple] = ("auto",)
    sends_only_selected: ClassVar[bool] = False
    default_bucket_bytes: ClassVar[int] = 0

    # -- options: checked when a transform is built, resolved when traced --

    @classmethod
    def check_options(cls, algorithm: str, wire) -> None:
        """Raises ValueError for an `algorithm` / `wire` (a Wire) this backend
        cannot run. Runs when a transform is built: asks no platform."""
        if algorithm not in cls.algorithms:
            raise ValueError(
                f"algorithm={algorithm!r} is not one of backend {cls.name!r}'s {cls.algorithms}"
            )

    def algorithm(self, requested: str, axes: tuple, wire) -> str:
        """The schedule that runs for `requested` (``"auto"`` resolved)."""
        self.check_options(requested, wire)
        return requested

    def adds_in_wire(self, algorithm: str) -> bool:
        """Whether `algorithm` adds partial sums in the wire dtype (then a
        float16 mean is prescaled with headroom, _xla.headroom_scales)."""
        return False

    # -- collectives --

    def allreduce(self, bound, flat, *, in_place: bool = False, parts=None):
        """The reduced `flat`, differentiated as ``lax.psum`` is. `parts`:
        static sizes of the parts of `flat` (the leaves of a bucket) where a
        wire scales parts one by one; `in_place`: the result may take flat's
        buffer."""
        raise NotImplementedError(f"backend {self.name!r} has no allreduce")

    def masked_allreduce(self, bound, flat, layout, mask, *, max_chunks, zero: bool):
        """The chunks of `flat` (cut as `layout` says) that `mask` selects,
        reduced; the others keep local values, or zeros with `zero` (then the
        result is the same on every device). `max_chunks`: `mask` selects at
        most that many (a static bound), or None."""
        raise NotImplementedError(f"backend {self.name!r} has no masked allreduce")

    def reduce_scatter(self, bound, flat):
        """This device's slice of ceil(size / N) elements of the reduction."""
        raise NotImplementedError(f"backend {self.name!r} has no reduce_scatter")

    def all_gather(self, bound, flat):
        """[N, size]: every device's `flat`, in rank order."""
        raise NotImplementedError(f"backend {self.name!r} has no all_gather")

    def all_gather_rows(self, bound, x, *, to: str):
        """[N, *x.shape]: every device's `x` (of any dtype: bytes too), in
        rank order, typed as `to` says (``"invarying"``: the same on every
        device, ``"varying"``). XLA's all-gather unless a backend has its own."""
        return jax.lax.all_gather(x, bound.reduction.axes, tiled=False, to=to)

    # An allreduce split in two calls, the second in a later execution of the
    # program: the exchange runs while the devices compute other steps.
    starts_async = False

    def allreduce_start(self, bound, flat, *, chunk_mask=None):
        """Starts the mean or sum of `flat` (of its chunks that `chunk_mask`
        selects, zeros elsewhere); returns a handle (an array) for
        :meth:`allreduce_done`. Not differentiable."""
        raise NotImplementedError(f"backend {self.name!r} cannot start an allreduce")

    def allreduce_done(self, bound, handle, like, *, missing_ok=False):
        """(result, found) of the started allreduce: the result shaped and of
        the dtype of `like`, typed replicated over every axis (as the handle
        is); a handle not in flight is an error, or with `missing_ok` found is
        0 and the result unwritten."""
        raise NotImplementedError(f"backend {self.name!r} cannot start an allreduce")

    def allreduce_bucket(self, bound, parts, *, in_place: bool, after):
        """One collective over `parts` (arrays of one dtype) as if they lay
        one after another; returns the reduced parts, shaped as given. Here:
        concatenated (a fresh buffer, which the result may take over), reduced
        and sliced back; `after` as in :meth:`after`, on the call's result."""
        flat = self.concatenate(bound.reduction.axes, [jnp.ravel(p) for p in parts])
        sizes = tuple(int(p.size) for p in parts)
        red = bound.allreduce(flat, in_place=in_place or len(parts) > 1, parts=sizes)
        if after:  # on the call's own result, before any slice or reshape reads it
            red = self.after(red, after)
        return _flat.split(red, [jnp.shape(p) for p in parts])

    # -- local passes (XLA's own code unless a backend has faster) --

    def concatenate(self, axes: tuple, flat_parts):
        """The 1-D `flat_parts` (local over `axes`) one after another."""
        return jnp.concatenate(flat_parts)

    def after(self, x, deps):
        """`x`, read only once every array in `deps` exists (where the
        platform's scheduler needs telling); here `x` as it is."""
        return x

    def pool(self, axes: tuple, parts, addend):
        """The flat `parts` (of addend's dtype) one after another, plus `addend`."""
        out, offset = jnp.zeros(addend.shape, addend.dtype), 0
        for part in parts:
            out = jax.lax.dynamic_update_slice(out, part, (offset,))
            offset += part.size
        return out + addend

    def chunk_l1(self, axes: tuple, layout, local, exchanged, mask):
        """float32[chunks]: the L1 norm of each chunk of `exchanged` where
        `mask` selects it, of `local` elsewhere (flat pools of one length)."""
        sent, kept = _two_l1(layout, exchanged, local)
        return jnp.where(mask, sent, kept)

    def chunk_residual(self, axes: tuple, layout, local, mask, *, decay: float, skip, old):
        """`decay * local` on the chunks `mask` leaves out and zeros on the
        others, in local's dtype; `old` where `skip` is set; shaped like `old`
        (the state's row: local's elements, any shape)."""
        sent = layout.elements(mask)
        new = (decay * jnp.where(sent, jnp.zeros((), local.dtype), local)).astype(local.dtype)
        return jnp.where(skip, old, new.reshape(old.shape))


def _two_l1(layout, *pools):
    """The float32 L1 norm of every chunk of each pool, in one reduction.

    One variadic reduction reads the pools once and writes nothing else:
    XLA CPU gives a plain sum to a library kernel that first copies its
    padded input (a whole pool of fresh memory per sum, and 4x the time).
    """
    zeros = tuple(jnp.float32(0) for _ in pools)
    return jax.lax.reduce(
        tuple(layout.as_rows(jnp.abs(p.astype(jnp.float32))) for p in pools),
        zeros,
        lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)),
        (1,),
    )
