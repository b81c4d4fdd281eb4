"""The fusion plan (lazy allreduce): which gradient leaves share one collective.

Backward produces the last layers' gradients first, so leaves are taken in
reverse tree order and packed greedily: a bucket closes as soon as it holds at
least ``bucket_bytes`` bytes. Leaves of different dtypes never share a bucket
(a bucket is one flat array); each dtype keeps its own open bucket. Buckets are
listed in the order they close, which is the order they become ready.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _flat
from jaxcomm._validate import check_bucket_bytes
from jaxcomm.collectives import to_varying, varying_axes


def plan_buckets(
    nbytes: Sequence[int],
    bucket_bytes: float,
    *,
    kinds: Sequence[Hashable] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Groups leaves into buckets of at least ``bucket_bytes`` bytes.

    Args:
      nbytes: bytes of each leaf, in tree order. Leaves of zero bytes need no
        communication and are in no bucket.
      bucket_bytes: the threshold θ. 0 gives one bucket per leaf, ``math.inf``
        one bucket per kind.
      kinds: optional key per leaf (e.g. its dtype); only leaves of one kind
        share a bucket.

    Returns:
      Buckets in the order they close; each is a tuple of leaf indices in the
      order they were added (reverse tree order).

    Examples:
      >>> plan_buckets([4, 4, 4, 4], 8)
      ((3, 2), (1, 0))
      >>> plan_buckets([4, 4, 4], 0)
      ((2,), (1,), (0,))
      >>> plan_buckets([4, 0, 4], float("inf"))
      ((2, 0),)
      >>> plan_buckets([4, 2, 4, 2], 8, kinds=["f32", "f16", "f32", "f16"])
      ((2, 0), (3, 1))
    """
    theta = check_bucket_bytes(bucket_bytes)
    if kinds is None:
        kinds = [None] * len(nbytes)
    if len(kinds) != len(nbytes):
        raise ValueError(f"kinds has {len(kinds)} entries for {len(nbytes)} leaves")
    closed: list[tuple[int, ...]] = []
    open_: dict[Hashable, tuple[list[int], int]] = {}
    last_added: dict[Hashable, int] = {}
    for step, i in enumerate(reversed(range(len(nbytes)))):
        size = int(nbytes[i])
        if size < 0:
            raise ValueError(f"leaf {i} has {size} bytes")
        if size == 0:
            continue
        members, total = open_.get(kinds[i], ([], 0))
        members.append(i)
        total += size
        last_added[kinds[i]] = step
        if total >= theta:
            closed.append(tuple(members))
            open_.pop(kinds[i], None)
        else:
            open_[kinds[i]] = (members, total)
    # Buckets still open are ready once backward is done; flush them in the
    # order their last leaf arrived.
    for kind in sorted(open_, key=last_added.__getitem__):
        closed.append(tuple(open_[kind][0]))
    return tuple(closed)


def leaf_buckets(leaves, bucket_bytes: float) -> tuple[tuple[int, ...], ...]:
    """:func:`plan_buckets` for arrays: their byte sizes, one dtype per bucket."""
    dtypes = [np.dtype(jnp.result_type(x)) for x in leaves]
    nbytes = [int(np.size(x)) * d.itemsize for x, d in zip(leaves, dtypes, strict=True)]
    return plan_buckets(nbytes, bucket_bytes, kinds=dtypes)


def buckets_payload(leaves, buckets, bound) -> int:
    """Bytes this device puts into the collectives of `buckets` (wire dtype,
    FP8 scales included: ``BoundReduction.payload_bytes``)."""
    return sum(
        bound.payload_bytes(
            sum(int(np.size(leaves[i])) for i in b), jnp.result_type(leaves[b[0]]), parts=len(b)
        )
        for b in buckets
    )


def reduce_in_buckets(
    leaves,
    bound,
    bucket_bytes: float,
    *,
    scale_back: bool = False,
    in_place: bool = True,
    after=(),
):
    """One allreduce per bucket of the fusion plan, each bucket split back into
    its leaves; returns (reduced leaves, payload bytes, number of collectives).

    Zero-size leaves are in no bucket and come back as they are. With
    `scale_back`, a narrow wire's mean is turned back into the sum
    (``BoundReduction.sum_from_mean``). `in_place`: a bucket of one leaf may
    take that leaf's buffer, and `after` holds arrays that must exist before
    anything reads a bucket's result (``BoundReduction.allreduce_bucket``).
    """
    buckets = leaf_buckets(leaves, bucket_bytes)
    out = list(leaves)
    for bucket in buckets:
        reduced = bound.allreduce_bucket(
            [leaves[i] for i in bucket], in_place=in_place, after=after
        )
        for i, red in zip(bucket, reduced, strict=True):
            out[i] = bound.sum_from_mean(red) if scale_back else red
    return out, buckets_payload(leaves, buckets, bound), len(buckets)


def start_in_buckets(leaves, bound, bucket_bytes: float) -> list:
    """Starts one allreduce per bucket of the fusion plan
    (``BoundReduction.allreduce_start``) and returns at once one int32[3]
    handle per leaf, its bucket's (zeros for a leaf in no bucket): the
    buckets are known only here, and init must shape the state per leaf.
    :func:`finish_in_buckets` takes them in a later step."""
    out = [jnp.zeros(3, jnp.int32)] * len(leaves)
    for bucket in leaf_buckets(leaves, bucket_bytes):
        flat = bound.backend.concatenate(
            bound.reduction.axes, [jnp.ravel(leaves[i]) for i in bucket]
        )
        handle = bound.allreduce_start(flat)
        for i in bucket:
            out[i] = handle
    return out


def finish_in_buckets(
    handles, sent, bound, bucket_bytes: float, *, scale_back: bool = False, after=()
):
    """:func:`reduce_in_buckets` of `sent` whose collectives
    :func:`start_in_buckets` started in an earlier step: each bucket's result
    is waited for, or, where this job did not start it (a state restored
    from a checkpoint, or the first step's zeros), `sent` is reduced here in
    the same bucket, with the same schedule: the same bits either way.
    Returns (reduced leaves, payload bytes, number of collectives)."""
    buckets = leaf_buckets(sent, bucket_bytes)
    out = list(sent)
    for bucket in buckets:
        parts = _finish(handles[bucket[0]], [sent[i] for i in bucket], bound, after)
        for i, red in zip(bucket, parts, strict=True):
            out[i] = bound.sum_from_mean(red) if scale_back else red
    return out, buckets_payload(sent, buckets, bound), len(buckets)


def _finish(handle, parts, bound, after):
    """One bucket's reduced parts: the started exchange's result, else
    `parts` reduced here, in one collective as the step would."""
    like = jax.ShapeDtypeStruct((sum(int(np.size(p)) for p in parts),), parts[0].dtype)
    result, found = bound.allreduce_done(handle, like, missing_ok=True)
    if after:
        # Read (by the cond) before the backward pass, the result's and the
        # flag's memory would be lent to it, and it would wait for the exchange.
        result, found = bound.after(result, after), bound.after(found, after)
    # Each part typed as the in-step collective's result (reduced over the
    # axes, still varying over those its gradient varies over beside them:
    # a bucket may hold a model's shards beside its replicated leaves) and
    # as the handle (replicated, unless the caller typed its state varying).
    axes = bound.reduction.axes
    types = [
        tuple(sorted({a for a in varying_axes(p) if a not in axes} | set(varying_axes(result))))
        for p in parts
    ]

    def typed(pieces):
        return [to_varying(x, t) if t else x for x, t in zip(pieces, types, strict=True)]

    def started(result, _):
        return typed(_flat.split(result, [jnp.shape(p) for p in parts]))

    def reduce_here(_, parts):
        return typed(bound.allreduce_bucket(parts, in_place=False))

    return jax.lax.cond(found > 0, started, reduce_here, result, parts)
