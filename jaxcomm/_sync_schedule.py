"""DiLoCo's sync schedule: which leaves each fragment holds, and at which step
of the ``sync_every``-step cycle it syncs.

Plain Python, with no JAX: :func:`jaxcomm.diloco` runs this schedule and the
cost model (:mod:`jaxcomm.costmodel.simulator`) prices it, from the same code.
"""

from __future__ import annotations

import numpy as np

from jaxcomm import _validate


def plan_fragments(sizes, fragments: int) -> tuple[tuple[int, int], ...]:
    """Cuts leaves (their element counts, in tree order) into contiguous fragments.

    The cut after fragment ``k`` is the leaf boundary whose element count so
    far is nearest to ``k/F`` of the total (ties to the earlier boundary),
    leaving at least one leaf to each fragment.

    Returns:
      ``(start, stop)`` leaf indices of each fragment.

    Examples:
      >>> plan_fragments([1, 5, 8, 7], 2)
      ((0, 3), (3, 4))
      >>> plan_fragments([4, 4, 4, 4], 4)
      ((0, 1), (1, 2), (2, 3), (3, 4))
    """
    n = len(sizes)
    if fragments > n:
        raise ValueError(f"fragments={fragments} needs at least that many leaves; params have {n}")
    bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    total = int(bounds[-1])
    cuts = [0]
    for k in range(1, fragments):
        candidates = range(cuts[-1] + 1, n - (fragments - k) + 1)
        # Compared as k*total vs F*bound, in integers: no float ties.
        cuts.append(min(candidates, key=lambda i: abs(fragments * int(bounds[i]) - k * total)))
    cuts.append(n)
    return tuple(zip(cuts[:-1], cuts[1:], strict=True))


def check_sync_schedule(sync_every, fragments) -> tuple[int, int]:
    """``sync_every`` (H) and ``fragments`` (F) as ints, if 1 <= F <= H.

    Each fragment syncs at its own step of the H-step cycle, so there can be
    no more fragments than steps. The cost model checks its settings here too.

    Examples:
      >>> check_sync_schedule(50, 5)
      (50, 5)
      >>> check_sync_schedule(2, 3)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: fragments=3 must be <= sync_every=2: each fragment syncs at ...
    """
    sync_every = _validate.check_positive_integer("sync_every", sync_every)
    fragments = _validate.check_positive_integer("fragments", fragments)
    if fragments > sync_every:
        raise ValueError(
            f"fragments={fragments} must be <= sync_every={sync_every}: each fragment "
            "syncs at its own step of the cycle"
        )
    return sync_every, fragments


def sync_offsets(sync_every: int, fragments: int) -> tuple[int, ...]:
    """Fragment f syncs after step s (from 0) when ``(s + 1) % sync_every`` is its offset.

    Examples:
      >>> sync_offsets(4, 1), sync_offsets(6, 3), sync_offsets(5, 2)
      ((0,), (2, 4, 0), (2, 0))
    """
    return tuple(((f + 1) * sync_every // fragments) % sync_every for f in range(fragments))


def check_delay(delay, sync_every: int) -> int:
    """``delay`` (τ) as an int, if 0 <= τ < ``sync_every``.

    A fragment's outer update lands τ steps after its sync; its next sync
    comes ``sync_every`` steps after the last, so it must land before that.
    Each fragment carries its own reduced pseudo-gradient, so fragments in
    flight at once (τ >= H/F) are fine.

    Examples:
      >>> check_delay(2, 6)
      2
      >>> check_delay(6, 6)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: delay=6 must be < sync_every=6: a fragment's outer update ...
    """
    delay = _validate.check_int("delay", delay, minimum=0)
    if delay >= sync_every:
        raise ValueError(
            f"delay={delay} must be < sync_every={sync_every}: a fragment's outer update "
            "must land before its next sync"
        )
    return delay


def syncs(step, offset: int, sync_every: int):
    """Whether a fragment with sync ``offset`` (:func:`sync_offsets`) sends its
    pseudo-gradient after step ``step`` (from 0; an int or an int array)."""
    return (step + 1) % sync_every == offset


def applies(step, offset: int, sync_every: int, delay: int):
    """Whether that fragment's outer update lands after step ``step``: ``delay``
    steps after a sync, the first sync included (so never before it).

    Examples:
      >>> [s for s in range(12) if applies(s, 0, 4, 1)]  # syncs after 3, 7, 11
      [4, 8]
      >>> [s for s in range(12) if applies(s, 2, 6, 0)] == [s for s in range(12) if syncs(s, 2, 6)]
      True
    """
    return ((step + 1) % sync_every == (offset + delay) % sync_every) & (step + 1 > delay)
