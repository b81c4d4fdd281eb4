"""chunk_sparse: coarse-grained sparse communication (GradientFlow, Algorithm 1).

The gradient pool (all leaves, flattened, in the order backward produces
them) is cut into chunks of ``chunk_size`` elements. Each step only the
important chunks (a mask every device agrees on) are packed into one dense
buffer and allreduced; the rest stay in a per-device residual, decayed by
``residual_decay`` (momentum correction). The wrapped optimizer updates the
important chunks only; its parameter-shaped state is held on the others.
The mask for the next step is the top ``density`` fraction of chunks by
allreduced L1 norm; density ramps from 1 to its final value during warm-up.
With double buffering the same runs one step late: a step's chunks leave as
it ends and the next step applies them (docs/double_buffering.md).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _flat, _validate
from jaxcomm.collectives import DEFAULT_CHUNK_SIZE, reduction, varying_axes
from jaxcomm.state import comm_stats, per_device
from jaxcomm.transforms import _in_shards
from jaxcomm.transforms._buckets import reduce_in_buckets


class ChunkSparseState(NamedTuple):
    """State of :func:`chunk_sparse`.

    Attributes:
      inner: the wrapped optimizer's state (same on every device).
      residual: ``PerDevice`` flat pool of what this device has not sent.
      mask: bool[chunks], the chunks exchanged at the next step; with
        ``double_buffering``, those of the exchange in flight (none before
        the first step).
      count: int32, exchanges applied (skipped non-finite ones do not count).
      stats: :class:`jaxcomm.CommStats` of the last step's applied exchange.
      sent: with ``double_buffering``, ``PerDevice`` flat pool that the
        exchange in flight carries (its ``mask`` chunks), kept for a job that
        restores this state without the exchange in flight; else ``()``.
      handle: where that exchange was started as the step ended (jaxcomm's
        CPU transport, across processes), its int32[3] handle; else ``()``.
    """

    inner: Any
    residual: per_device.PerDevice
    mask: jax.Array
    count: jax.Array
    stats: comm_stats.CommStats
    sent: Any = ()
    handle: Any = ()


def chunk_sparse(
    inner: optax.GradientTransformation,
    axis_name,
    *,
    density: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    warmup_steps: int = 0,
    residual_decay: float = 0.9,
    wire_dtype=None,
    algorithm: str = "auto",
    backend: str = "auto",
    double_buffering: bool = False,
) -> optax.GradientTransformation:
    """Exchanges only the most important chunks of the gradient, then runs ``inner``.

    Give it each device's local gradients inside ``jax.shard_map`` or ``jax.pmap``,
    in place of a dense ``allreduce_gradients`` in front of the optimizer. The
    flat gradient pool is cut into chunks of ``chunk_size`` elements; ``r`` is this
    device's residual, ``m`` the mask of chunks exchanged (all at step 0). Each step::

      g <- g + r;   a = mean over devices of g on m, 0 elsewhere
      update = inner.update(a) on m, 0 elsewhere      (inner's state held off m)
      r <- 0 on m, residual_decay * g elsewhere
      m <- the top density(t+1) of chunks by L1 norm of g, summed over devices

    ``density(t)`` goes linearly from 1 to ``density`` over ``warmup_steps``. A step
    whose averaged chunks or norms are not finite is skipped on every device (zero
    update, state unchanged, ``stats.nonfinite`` set). With ``inner=optax.sgd(lr,
    momentum=0.9)`` and ``residual_decay=0.9`` it is GradientFlow's Algorithm 1;
    see docs/design.md, "Chunk-sparse communication"; its quality around Adam(W):
    docs/chunk_sparse.md.

    Args:
      inner: the optimizer to run on the exchanged gradient; it sees zeros off the
        mask, so clipping goes inside it (docs/compose.md).
      axis_name: mesh or pmap axis name(s), as in :func:`jaxcomm.allreduce`.
      density: final fraction of chunks exchanged, in (0, 1].
      chunk_size: elements per chunk (32768, as GradientFlow); ``init`` warns if too few.
      warmup_steps: steps over which density ramps from 1 to ``density``.
      residual_decay: factor in [0, 1] on the unsent gradient kept for the next step.
      wire_dtype: ``None``, a 16-bit float or (xla only) an 8-bit float, for the chunks.
      algorithm, backend: as in :func:`jaxcomm.allreduce`; ``backend="auto"`` is
        ffi where available (only the selected chunks travel).
      double_buffering: run the above one step late: step t applies the chunks
        of step t-1 (a zero update at step 0), so that their exchange can
        travel while step t computes. On CPU across processes (backend ffi,
        no wire or a 16-bit one) the exchange starts as step t-1 ends;
        elsewhere it runs under step t's forward and backward passes. A
        non-finite exchange is known a step late: that step is skipped and
        this device's residual dropped (docs/double_buffering.md).

    Returns:
      An ``optax.GradientTransformation`` with :class:`ChunkSparseState`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = jaxcomm.chunk_sparse(optax.sgd(0.1, momentum=0.9), "data",
      ...                           density=0.25, chunk_size=4)
      >>> params = {"w": jnp.zeros(16)}
      >>> with jax.set_mesh(mesh):
      ...     state = tx.init(params)
      >>> specs = jaxcomm.state_specs(state, "data")
      >>> def step(params, state, g):
      ...     updates, state = tx.update({"w": g[0]}, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
      ...                             out_specs=(P(), specs)))
      >>> g = jnp.tile(jnp.arange(16.0), (jax.device_count(), 1))
      >>> g = jax.device_put(g, jax.sharding.NamedSharding(mesh, P("data")))
      >>> params, state = run(params, state, g)  # step 0: every chunk travels
      >>> state.mask.tolist(), float(jaxcomm.get_stats(state).density)  # largest goes next
      ([False, False, False, True], 1.0)

    References:
      Sun et al., `Optimizing Network Performance for Distributed DNN Training on
      GPU Clusters: ImageNet/AlexNet Training in 1.5 Minutes
      <https://arxiv.org/abs/1902.06855>`_, 2019 (GradientFlow)
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"inner={inner!r} must be an optax.GradientTransformation, e.g. optax.sgd(0.1)"
        )
    density = _validate.check_fraction("density", density, zero=False)
    exchange = reduction(
        axis_name,
        op="mean",
        wire_dtype=wire_dtype,
        algorithm=algorithm,
        backend=backend,
        masked=True,
        chunk_size=chunk_size,
        started=double_buffering,
    )
    warmup_steps = _validate.check_count("warmup_steps", warmup_steps)
    residual_decay = _validate.check_fraction("residual_decay", residual_decay, zero=True)
    # The norms go the same way as the chunks: 'auto' resolves as for a mask.
    norm_sum = reduction(axis_name, op="sum", backend=backend, masked=True)
    # A sharded model's leaves that are whole on every shard are averaged
    # densely (see _pooled).
    dense_mean = reduction(
        axis_name, op="mean", wire_dtype=wire_dtype, algorithm=algorithm, backend=backend
    )

    def init(params):
        leaves = jax.tree.leaves(params)
        specs = per_device.declared_specs(params)
        pooled, others = _pooled_at_init(specs, exchange.axes)
        pool = [(x, s) for x, s, p in zip(leaves, specs, pooled, strict=True) if p]
        pool_leaves = [x for x, _ in pool]
        layout = exchange.layout(sum(_local_size(x, s, others) for x, s in pool))
        _warn_if_not_sparse(layout, density)
        if double_buffering and others:
            raise ValueError(
                f"chunk_sparse(double_buffering=True) takes a model replicated over the mesh "
                f"axes other than {exchange.axes}; these params are split over {others}. "
                "Leave double_buffering off, or use jaxcomm.allreduce_gradients("
                "double_buffering=True) for such a model"
            )
        # Each shard's own pool and mask: rows over the other axes, if any.
        shards = (_shard_count(others),) if others else ()
        pool_zeros = jax.ShapeDtypeStruct((*shards, layout.size), _pool_dtype(pool_leaves))
        nchunks = max(layout.nchunks, 1)
        if double_buffering:
            # Nothing in flight yet: the first step finishes no exchange.
            return ChunkSparseState(
                inner=inner.init(params),
                residual=per_device.per_device_zeros(pool_zeros, exchange),
                mask=jnp.zeros((nchunks,), jnp.bool_),
                count=jnp.int32(0),
                stats=comm_stats.empty_stats(),
                sent=per_device.per_device_zeros(pool_zeros, exchange, "sent pool"),
                handle=jnp.zeros(3, jnp.int32) if exchange.starts_between_steps else (),
            )
        return ChunkSparseState(
            inner=inner.init(params),
            residual=_per_shard(
                per_device.per_device_zeros(pool_zeros, exchange), exchange.axes, others
            ),
            # An empty gradient keeps a one-chunk mask, which it never sends.
            mask=_placed(jnp.ones((*shards, nchunks), jnp.bool_), others),
            count=jnp.int32(0),
            stats=comm_stats.empty_stats(),
        )

    def update(updates, state, params=None):
        all_leaves, treedef = jax.tree.flatten(updates)
        exchange.check_dtypes(updates)
        bound = exchange.bind()
        bound.check_local(updates)
        pooled = _pooled(all_leaves, bound.place.others)
        leaves = [x for x, p in zip(all_leaves, pooled, strict=True) if p]
        size = sum(int(np.size(x)) for x in leaves)
        _check_pool_size(updates, size, state, params)
        layout = bound.layout(size)
        if size == 0:  # nothing to exchange: no collective, only the inner step
            upd, inner_state = inner.update(updates, state.inner, params)
            return upd, state._replace(inner=inner_state, count=state.count + 1)
        if double_buffering:
            return _one_step_late(updates, state, params, bound, leaves, layout)
        mask = state.mask.reshape(-1)  # this shard's, of a sharded model's
        old_residual = state.residual.value

        g = bound.pool(
            _pool_parts(leaves, _pool_dtype(leaves)), per_device.local(state.residual).reshape(-1)
        )
        elem_mask = layout.elements(mask)
        # Important chunks averaged (the same on every device), zeros elsewhere.
        exchanged, payload = bound.exchange(g, mask, max_chunks=layout.selected(density))
        # Next mask from the summed per-chunk L1 norms (one small collective).
        # An important chunk holds the average on every device: count it once.
        l1 = bound.chunk_l1(g, exchanged, mask)
        norms = jnp.where(mask, l1 / bound.size, l1)
        norms = norm_sum.bind().allreduce(norms)
        next_density = _density(state.count + 1, density, warmup_steps)
        next_mask = _top_chunks(norms, layout.selected(next_density))

        dense = [x for x, p in zip(all_leaves, pooled, strict=True) if not p]
        dense_bound = dense_mean.bind() if dense else None
        reduced, dense_payload, dense_count = (
            reduce_in_buckets(dense, dense_bound, math.inf) if dense else ([], 0, 0)
        )
        # The norms see every exchanged value (it is zero outside the mask) and
        # |inf| and NaN survive the sums, so they flag a non-finite step on
        # their own: no pass over the pool (XLA CPU made sum(x * 0) a dot
        # against a materialised pool of zeros). A sharded model's shards
        # agree on it (one scalar over the other axes).
        nonfinite = comm_stats.agreed_any(
            ~jnp.all(jnp.isfinite(norms)) | comm_stats.any_nonfinite(reduced)
        )
        grads = _merge(_from_pool(exchanged, leaves), reduced, pooled)
        masks = _merge(
            _from_pool(elem_mask, leaves), [jnp.ones(jnp.shape(x), bool) for x in dense], pooled
        )
        grads, masks = jax.tree.unflatten(treedef, grads), jax.tree.unflatten(treedef, masks)
        upd, inner_state = inner.update(grads, state.inner, params)
        # A non-finite step is skipped everywhere: every device sees the same
        # averaged chunks and norms, so they all take it. The skip and the
        # mask make one select per leaf (measured: 7% less temporary memory
        # than a select for each).
        keep = jax.tree.map(lambda m: m & ~nonfinite, masks)
        upd = jax.tree.map(lambda u, m: jnp.where(m, u, jnp.zeros_like(u)), upd, keep)
        inner_state = _hold_unselected(inner_state, state.inner, keep, nonfinite)

        norm_payload = layout.nchunks * 4
        dense_size = sum(int(np.size(x)) for x in dense)
        payload = payload + norm_payload + dense_payload
        # Of a sharded model, the mean over its shards (each has its mask).
        others = bound.place.others
        payload = comm_stats.agreed_mean(payload.astype(jnp.float32), others)
        selected = layout.selected_elements(mask) + dense_size
        stats = comm_stats.CommStats(
            payload_bytes=payload,
            bytes_sent=bound.bytes_sent(payload),
            collectives=jnp.int32(2 + dense_count),
            density=comm_stats.agreed_mean(selected / np.float32(size + dense_size), others),
            nonfinite=nonfinite,
        )

        residual = bound.chunk_residual(
            g, mask, decay=residual_decay, skip=nonfinite, old=old_residual
        )
        new = ChunkSparseState(
            inner=inner_state,
            residual=per_device.PerDevice(residual),
            mask=_unless(nonfinite, next_mask.reshape(state.mask.shape), state.mask),
            count=_unless(nonfinite, state.count + 1, state.count),
            stats=stats,
        )
        return upd, new

    def _one_step_late(updates, state, params, bound, leaves, layout):
        """The step above run one step late: this step applies the exchange
        of the previous step's pool (on `state.mask`) and starts its own."""
        started = exchange.starts_between_steps
        flying = state.mask
        pending = jnp.any(flying)  # none before the first step
        sent = per_device.local(state.sent).reshape(-1)
        # Read after this step's backward pass: earlier, the result's memory
        # would be lent to it, and it would wait for the exchange.
        after = [bound.after(jnp.zeros((), jnp.int32), leaves)]
        max_chunks = layout.selected(density)

        def here(_, pool):
            return bound.exchange(pool, flying, max_chunks=max_chunks)[0]

        if started:
            result, found = bound.allreduce_done(state.handle, sent, missing_ok=True)
            result, found = bound.after(result, after), bound.after(found, after)
            # Not in flight in this job (a restored state): reduced here, to the same bits.
            exchanged = jax.lax.cond(found > 0, lambda r, _: r, here, result, sent)
        else:
            exchanged = bound.after(here(None, sent), after)
        payload = bound.exchange_payload(sent, flying, max_chunks=max_chunks)

        # The next mask, as the step above computes it from the same pool.
        l1 = bound.chunk_l1(sent, exchanged, flying)
        norms = norm_sum.bind().allreduce(jnp.where(flying, l1 / bound.size, l1))
        nonfinite = pending & comm_stats.agreed_any(~jnp.all(jnp.isfinite(norms)))
        applied = pending & ~nonfinite
        chosen = _top_chunks(
            norms, layout.selected(_density(state.count + 1, density, warmup_steps))
        )
        # A skipped exchange's chunks go again; the first step sends every chunk.
        mask = jnp.where(applied, chosen, jnp.where(pending, flying, True))

        treedef = jax.tree.structure(updates)
        grads = jax.tree.unflatten(treedef, _from_pool(exchanged, leaves))
        masks = jax.tree.unflatten(treedef, _from_pool(layout.elements(flying), leaves))
        upd, inner_state = inner.update(grads, state.inner, params)
        keep = jax.tree.map(lambda m: m & applied, masks)
        upd = jax.tree.map(lambda u, m: jnp.where(m, u, jnp.zeros_like(u)), upd, keep)
        inner_state = _hold_unselected(inner_state, state.inner, keep, ~applied)

        # This step's pool leaves now. The residual that went into a skipped
        # exchange's pool may hold its non-finite values: it is dropped.
        old_residual = state.residual.value
        residual = per_device.local(state.residual).reshape(-1)
        parts = _pool_parts(leaves, _pool_dtype(leaves))
        pool = bound.pool(parts, residual)
        pool = jax.lax.cond(
            nonfinite, lambda: bound.pool(parts, jnp.zeros_like(residual)), lambda: pool
        )
        handle = bound.allreduce_start(pool, chunk_mask=mask) if started else ()
        residual = bound.chunk_residual(
            pool, mask, decay=residual_decay, skip=jnp.bool_(False), old=old_residual
        )

        norm_payload = layout.nchunks * 4
        stats = comm_stats.CommStats(
            payload_bytes=payload + norm_payload,
            bytes_sent=bound.bytes_sent(payload + norm_payload),
            collectives=jnp.int32(2),
            density=layout.density(flying),
            nonfinite=nonfinite,
        )
        return upd, ChunkSparseState(
            inner=inner_state,
            residual=per_device.PerDevice(residual),
            mask=mask,
            count=state.count + applied.astype(jnp.int32),
            stats=stats,
            sent=per_device.PerDevice(pool.reshape(jnp.shape(state.sent.value))),
            handle=handle,
        )

    return optax.GradientTransformation(init, _in_shards.in_shards(update, exchange.axes))


def _pooled(leaves, others: tuple) -> list[bool]:
    """Which leaves go into the chunk pool: all of them, but where the model
    is sharded over other mesh axes (``others``, bound here: "fsdp"), a leaf
    that is whole on every shard of them (a bias, typed as the same over
    them) is averaged densely instead. Each shard cuts its own pool into
    chunks and picks its own mask (agreed over the reduced axes), and a
    leaf held whole by several shards would otherwise be updated where one
    shard's mask sends it and not where another's does."""
    if not others:
        return [True] * len(leaves)
    out = [set(others) <= set(varying_axes(x)) for x in leaves]
    # A model whole on every device of the other axes, or untyped (pmap,
    # check_vma=False): pooled whole, as init does.
    return out if any(out) else [True] * len(leaves)


def _pooled_at_init(specs, axes: tuple) -> tuple[list[bool], tuple]:
    """:func:`_pooled` for params placed with `specs` (outside shard_map,
    from :func:`per_device.declared_specs`): a leaf is pooled when it is
    split over every mesh axis besides `axes`. Returns the flags and those
    other axes (none without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    others = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in axes)
    if not others:
        return [True] * len(specs), ()
    flags = []
    for spec in specs:
        named = {a for e in spec or () for a in per_device.spec_axes(e)}
        flags.append(set(others) <= named)
    if not any(flags):  # a model replicated over every axis: pooled whole, as before
        return [True] * len(specs), ()
    return flags, others


def _shard_count(others: tuple) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(dict(mesh.shape)[a] for a in others)


def _local_size(x, spec, others: tuple) -> int:
    """Elements of this device's shard of `x` (placed with `spec`)."""
    if not others:
        return int(np.size(x))
    mesh = dict(jax.sharding.get_abstract_mesh().shape)
    split = [a for e in spec or () for a in per_device.spec_axes(e)]
    return int(np.size(x)) // math.prod(mesh[a] for a in split)


def _placed(x, others: tuple):
    """`x` (rows over the shards first) split over `others` where init runs
    under a mesh."""
    return per_device.place(x, jax.sharding.PartitionSpec(others)) if others else x


def _per_shard(residual: per_device.PerDevice, axes: tuple, others: tuple):
    """A PerDevice pool (rows over `axes`) with rows over the shards after
    the device rows, split over `others` too."""
    if not others:
        return residual
    row = per_device.row_name(axes)
    return per_device.PerDevice(
        per_device.place(residual.value, jax.sharding.PartitionSpec(row, others))
    )


def _merge(pooled_leaves, dense_leaves, pooled) -> list:
    """The leaves back in tree order from the pooled and the dense ones."""
    a, b = iter(pooled_leaves), iter(dense_leaves)
    return [next(a) if p else next(b) for p in pooled]


def _check_pool_size(updates, size: int, state: ChunkSparseState, params) -> None:
    """A gradient of another size than the residual pool: name the leaf that
    differs from the params where they are given."""
    pool = jnp.shape(state.residual.value)[-1]
    if size == pool:
        return
    if params is not None:
        _validate.check_same_tree(updates, params, "params")
    raise ValueError(
        f"the gradient has {size} elements, the optimizer state was built for params with "
        f"{pool}: the gradient's tree must be that of those params"
    )


def _warn_if_not_sparse(layout, density: float) -> None:
    """Warns (once per call site, Python's default) when whole chunks make the
    density unreachable: at least twice what was asked for."""
    size, nchunks, chunk_size = layout.size, layout.nchunks, layout.chunk_size
    if size == 0:
        return
    reachable = layout.reachable(density)
    if reachable < 2 * density:
        return
    if size * density >= 1:
        # ceil(size / c) >= 1 / density chunks, so whole chunks overshoot by under 2x.
        fix = f"A chunk_size of at most {int(size * density)} gives 1/density chunks or more."
    else:
        fix = "The gradient has fewer than 1/density elements: no chunk_size reaches it."
    warnings.warn(
        f"chunk_sparse: {size} gradient elements make {nchunks} chunk(s) of "
        f"chunk_size={chunk_size}, and at least one whole chunk travels each step, so "
        f"density={density:g} is not reachable: each step exchanges {reachable:.3g} of "
        f"the gradient. {fix}",
        stacklevel=3,
    )


def _pool_dtype(leaves):
    wide = [
        np.dtype(jnp.result_type(x)) for x in leaves if np.dtype(jnp.result_type(x)).itemsize > 4
    ]
    return jnp.float64 if wide else jnp.float32


def _pool_parts(leaves, dtype):
    """Leaves in the order backward produces them (reverse tree order), flat."""
    return [jnp.ravel(x).astype(dtype) for x in reversed(leaves)]


def _from_pool(pool, leaves):
    """Inverse of :func:`_pool_parts`: leaves shaped (and, but for a mask's
    flags, typed) as `leaves`."""
    parts = _flat.split(pool, [jnp.shape(x) for x in reversed(leaves)])[::-1]
    return [
        p if p.dtype == jnp.bool_ else p.astype(jnp.result_type(x))
        for p, x in zip(parts, leaves, strict=True)
    ]


def _density(step, final: float, warmup: int):
    """1 at step 0, then linearly to `final` at `warmup` (final from step 1 when warmup is 0)."""
    if warmup == 0:
        return jnp.where(step == 0, 1.0, final).astype(jnp.float32)
    frac = jnp.minimum(step, warmup).astype(jnp.float32) / warmup
    return (1.0 + (final - 1.0) * frac).astype(jnp.float32)


def _top_chunks(norms, k):
    """The `k` chunks of largest norm."""
    nchunks = norms.shape[0]
    # Stable order by decreasing norm: ties go to the earlier chunk.
    order = jnp.argsort(-norms, stable=True)
    rank = jnp.zeros((nchunks,), jnp.int32).at[order].set(jnp.arange(nchunks, dtype=jnp.int32))
    return rank < k


def _unless(skipped, new, old):
    """`new`, or `old` where the step is `skipped` (trees of the same structure)."""
    return jax.tree.map(lambda a, b: jnp.where(skipped, b, a), new, old)


def _hold_unselected(new, old, masks, skipped):
    """Parameter-shaped parts of the inner state take the new value only where
    `masks` hold; everything else (counts, schedules) takes the new value
    unless the step is `skipped`."""
    param_def = jax.tree.structure(masks)
    shapes = [m.shape for m in jax.tree.leaves(masks)]

    def is_param_shaped(node):
        try:
            if jax.tree.structure(node) != param_def:
                return False
        except Exception:  # noqa: BLE001 - not a pytree we can compare
            return False
        return [jnp.shape(x) for x in jax.tree.leaves(node)] == shapes

    def hold(n, o):
        if is_param_shaped(n):
            return jax.tree.map(lambda a, b, m: jnp.where(m, a, b), n, o, masks)
        return _unless(skipped, n, o)

    return jax.tree.map(hold, new, old, is_leaf=is_param_shaped)
