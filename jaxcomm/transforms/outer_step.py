"""OuterStep: what :func:`jaxcomm.diloco` asks of its outer step, and optax's.

At a fragment's sync diloco hands the outer step the global params of the
last sync (``anchor``) and this device's local ones; the outer step decides
what travels and how (:meth:`OuterStep.reduce`), and what the averaged
pseudo-gradient does to the global params (:meth:`OuterStep.apply`).
:class:`OptaxOuter` runs any optax optimizer on a dense average;
:class:`jaxcomm.SparseOuter` (SparseLoCo) sends a sparse one. diloco knows no
implementation by name: a new outer step is one class here or beside it.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np

from jaxcomm import _validate
from jaxcomm.state import comm_stats, per_device
from jaxcomm.transforms._buckets import buckets_payload, leaf_buckets, reduce_in_buckets

__all__ = ["OptaxOuter", "OuterStep", "as_outer_step"]


@runtime_checkable
class OuterStep(Protocol):
    """An outer step for :func:`jaxcomm.diloco`, run on each fragment's
    leaves (lists of arrays) at its sync.

    Attributes:
      name: how error messages name it, e.g. ``"jaxcomm.sparse_outer"``.
      can_start: its exchange is one dense allreduce per group of leaves
        (:meth:`outgoing` says what is sent), which diloco may start at the
        sync and finish at the landing ``delay`` steps later.
    """

    name: ClassVar[str]
    can_start: ClassVar[bool]

    def init(self, leaves):
        """The outer state of a fragment of `leaves` (the same on every device)."""

    def init_error(self, parts, comm) -> per_device.PerDevice:
        """Per fragment (`parts`, lists of leaves), per device: the error
        feedback it keeps between syncs, or ``PerDevice(())``."""

    def reduce(self, anchor, local, error, bound, theta):
        """(the averaged pseudo-gradient in the params' dtypes, the error
        buffers after this send) of one fragment; `bound` the
        :class:`jaxcomm.collectives.BoundReduction`, `theta` its bucket bytes."""

    def apply(self, mean, outer_state, anchor):
        """(updates, outer state): the outer step from `anchor` on `mean`."""

    def cost(self, anchor, bound, theta):
        """(payload bytes, bytes on the wire, collectives, elements sent) of a sync."""


def as_outer_step(outer, *, error_feedback: bool) -> OuterStep:
    """`outer` as diloco runs it: an :class:`OuterStep` as it is, an optax
    optimizer as :class:`OptaxOuter`.

    Raises:
      TypeError: `outer` is neither.
      ValueError: `error_feedback` with an OuterStep, which keeps its own.
    """
    if isinstance(outer, OuterStep):
        if error_feedback and isinstance(outer, OptaxOuter):
            raise ValueError(
                "error_feedback=True with an OptaxOuter: build it as OptaxOuter(optimizer, "
                "error_feedback=True), or pass the optax optimizer itself as outer="
            )
        if error_feedback:
            raise ValueError(
                "error_feedback=True is for a dense outer step over a narrow wire; "
                f"{outer.name} keeps its own error-feedback buffer"
            )
        return outer
    return OptaxOuter(outer, error_feedback=bool(error_feedback))


class OptaxOuter(OuterStep):
    """DiLoCo's outer step: any optax optimizer on the averaged pseudo-gradient,
    which travels dense, in ``bucket_bytes`` buckets (:func:`jaxcomm.allreduce`);
    with `error_feedback`, what the wire dropped at a sync is sent at the next."""

    name = "an optax outer step"
    can_start = True

    def __init__(self, outer, *, error_feedback: bool = False):
        _validate.check_optimizer("outer", outer)
        self.outer = outer
        self.error_feedback = error_feedback

    def init(self, leaves):
        return self.outer.init(leaves)

    def init_error(self, parts, comm):
        if not self.error_feedback:
            return per_device.PerDevice(())
        return per_device.per_device_zeros(
            tuple(list(part) for part in parts), comm, "error feedback"
        )

    def outgoing(self, anchor, local, error, bound):
        """What this device sends: params - local, plus what the wire dropped
        last time; and the error buffers after this send (None without
        error feedback). A non-finite value keeps the old buffer."""
        delta = [g - x for g, x in zip(anchor, local, strict=True)]
        if error is None:
            return delta, None
        sent = [d + e for d, e in zip(delta, error, strict=True)]
        bad = comm_stats.any_nonfinite(sent)
        return sent, [
            jnp.where(bad, e, bound.cast_error(x)) for x, e in zip(sent, error, strict=True)
        ]

    def reduce(self, anchor, local, error, bound, theta):
        sent, error = self.outgoing(anchor, local, error, bound)
        return reduce_in_buckets(sent, bound, theta)[0], error

    def apply(self, mean, outer_state, anchor):
        return self.outer.update(mean, outer_state, anchor)

    def cost(self, anchor, bound, theta):
        buckets = leaf_buckets(anchor, theta)
        payload = buckets_payload(anchor, buckets, bound)
        return payload, bound.bytes_sent(payload), len(buckets), sum(map(np.size, anchor))
