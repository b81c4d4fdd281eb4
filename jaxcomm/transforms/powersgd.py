"""powersgd: low-rank gradient compression (PowerSGD, Vogels et al. 2019).

Each large enough matrix-shaped gradient M is sent as two thin factors, one
step of power iteration per training step: P = M Q averaged over the
devices and orthonormalised, then Q = M^T P averaged; every device applies
P Q^T. Q is warm-started from the last step, and what P Q^T misses stays in
a per-device residual that joins the next step's gradient (error feedback).
The P of all matrices travel in one collective, their Q in a second, and the
leaves too small to compress in a third, dense one.
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
from jaxcomm.collectives import over_shards, reduction, varying_axes
from jaxcomm.state import comm_stats, per_device
from jaxcomm.transforms import _in_shards, _stacks
from jaxcomm.transforms._buckets import reduce_in_buckets

# PowerSGD's small products decide what is sent: keep them in full float32 on
# every platform (a TF32 or bfloat16 pass would change the factors).
_PRECISION = jax.lax.Precision.HIGHEST


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`.

    The compressed leaves are those of ``ndim >= 2`` that pass the
    compression rule, in tree order; ``residual`` and ``q`` hold one entry
    for each of them.

    Attributes:
      residual: ``PerDevice`` tuple of error-feedback residuals, each of its
        leaf's shape and dtype, or ``()`` without error feedback.
      q: tuple of the Q factors, ``(cols, rank)`` each, that the next step
        starts from (warm start), or ``()`` without warm start.
      count: int32, steps taken (a non-finite step does not count).
      stats: :class:`jaxcomm.CommStats` of the last step.
    """

    residual: Any
    q: Any
    count: jax.Array
    stats: comm_stats.CommStats


class _Matrix(NamedTuple):
    """A compressed leaf: its index in the tree, its (whole) matrix view, its
    rank, and the mesh axes its rows and its columns are split over where the
    model is sharded (rows: the leaf's first dimension; columns: its second)."""

    leaf: int
    rows: int
    cols: int
    rank: int
    row_axes: tuple = ()
    col_axes: tuple = ()


# The defaults' choices (docs/powersgd.md, "Defaults", has the measurements).
# Dense steps before compression: the first, fast-changing gradients go whole.
DEFAULT_START_STEP = 50
# Without a rank, a matrix's is min(rows, cols) / this: its factors are
# (rows + cols) / (4 min(rows, cols)) of it, 2x smaller for a square one
# (the default min_compression_rate's bound).
DEFAULT_RANK_DIVISOR = 4


def powersgd(
    axis_name,
    *,
    rank: int | None = None,
    start_step: int = DEFAULT_START_STEP,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
    mask="auto",
    stacked="auto",
    wire_dtype=None,
    algorithm: str = "auto",
    backend: str = "auto",
) -> optax.GradientTransformation:
    """Averages gradients over ``axis_name``, sending large matrices as low-rank factors.

    Put it first in an ``optax.chain``, as :func:`jaxcomm.allreduce_gradients`,
    inside ``jax.shard_map`` or ``jax.pmap``. A leaf of ``ndim >= 2`` is a matrix
    M of shape ``(shape[0], prod(shape[1:]))`` (each layer of a ``stacked`` leaf
    is one), compressed at rank ``r = min(rank,
    rows, cols)`` when ``mask`` allows it and ``(rows + cols) * r *
    min_compression_rate <= rows * cols``. After ``start_step`` dense steps, for
    each M, with ``e`` this device's residual, ``Q`` the last step's factor and
    ``mean`` over the devices::

      M <- g + e;   P <- gram_schmidt(mean(M Q));   Q <- mean(M^T P)
      out = P Q^T (the same on every device);       e <- M - P Q^T

    Other leaves go dense (three collectives a step); docs/powersgd.md has more.

    Args:
      axis_name: mesh or pmap axis name(s), as in :func:`jaxcomm.allreduce`.
      rank: columns of P and Q, > 0; ``None``: ``min(rows, cols) // 4``, at least 1.
      start_step: steps averaged densely before compression starts, >= 0.
      min_compression_rate: compress where the factors are this many times smaller.
      error_feedback: keep ``e`` per device and add it to the next step's gradient.
      warm_start, seed: start from the last step's Q; seed of the draws of new Q columns.
      mask: ``"auto"`` (an embedding-like matrix stays dense: docs/powersgd.md),
        ``None`` (any matrix), or as optax's ``mask``: False keeps a leaf dense.
      stacked: leaves whose first axis stacks layers (``nn.scan``), one matrix each:
        ``"auto"`` (Flax metadata names it ``"layers"``), ``None``, or as ``mask``.
      wire_dtype: ``None``, ``jnp.float16`` or ``jnp.bfloat16`` for every collective
        (the factors in float32; float64 for float64 gradients).
      algorithm, backend: as in :func:`jaxcomm.allreduce`.

    Returns:
      An ``optax.GradientTransformation`` with :class:`PowerSGDState`;
      ``get_stats(state).density``: bytes sent over a dense step's.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = optax.chain(jaxcomm.powersgd("data", rank=2, start_step=0), optax.sgd(0.1))
      >>> params = {"kernel": jnp.zeros((64, 32)), "bias": jnp.zeros(32)}
      >>> with jax.set_mesh(mesh):
      ...     state = tx.init(params)
      >>> specs = jaxcomm.state_specs(state, "data")
      >>> def step(params, state, g):
      ...     updates, state = tx.update(jax.tree.map(lambda x: x[0], g), state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
      ...                             out_specs=(P(), specs)))
      >>> rng = np.random.default_rng(0)
      >>> g = {k: rng.standard_normal((jax.device_count(), *v.shape), np.float32)
      ...      for k, v in params.items()}
      >>> g = jax.device_put(g, jax.NamedSharding(mesh, P("data")))
      >>> params, state = run(params, state, g)
      >>> stats = jaxcomm.get_stats(state)
      >>> int(stats.collectives), round(float(stats.density), 4)  # P, Q, the bias
      (3, 0.1077)

    References:
      Vogels, Karimireddy and Jaggi, `PowerSGD <https://arxiv.org/abs/1905.13727>`_, 2019.
    """
    rank, start_step, min_compression_rate, seed = _check_options(
        rank, start_step, min_compression_rate, error_feedback, warm_start, seed, mask
    )
    if isinstance(stacked, str) and stacked != "auto":
        raise ValueError(
            f"stacked={stacked!r} must be 'auto', None, a pytree of bools or a callable"
        )
    if stacked is not None and not isinstance(stacked, str) and not callable(stacked):
        _check_mask_leaves(stacked, "stacked")
    comm = reduction(
        axis_name, op="mean", wire_dtype=wire_dtype, algorithm=algorithm, backend=backend
    )

    # Each tree's leaves as init saw them: whole shapes and the mesh axes of
    # each dimension, where params are sharded over other axes than
    # axis_name ("fsdp"); update sees only its shards.
    # And which leaves stack layers (see _stacks), each layer a leaf of its own
    # (the layouts and `leaves` below are of those expanded leaves).
    layouts: dict = {}
    stacks: dict = {}

    def matrices(tree, leaves) -> list[_Matrix]:
        key = per_device.plain_structure(tree)
        layout, stack = layouts.get(key), stacks.get(key, _stacks.Stacks(()))
        allowed = _allowed(mask, tree, layout)
        if allowed is not None and not isinstance(mask, str):  # one flag per leaf of `tree`
            allowed = stack.repeat(allowed)
        return _matrices(leaves, rank, min_compression_rate, allowed, layout)

    def init(params):
        whole = jax.tree.leaves(params)
        specs = per_device.declared_specs(params)
        key = per_device.plain_structure(params)
        stack = stacks[key] = _stacks.find(params, stacked, specs)
        leaves = stack.expand(whole)
        specs = _layer_specs(specs, stack)
        layouts[key] = tuple(_layout(x, s) for x, s in zip(leaves, specs, strict=True))
        mats = matrices(params, leaves)
        if leaves and math.isfinite(min_compression_rate):  # inf: dense on purpose
            _warn_dense(params, whole, stack, layouts[key], mats, mask, rank, min_compression_rate)
        residual = ()
        if error_feedback:
            residual = per_device.per_device_zeros(
                tuple(leaves[m.leaf] for m in mats), comm, specs=[specs[m.leaf] for m in mats]
            )
        q = ()
        if warm_start:
            q = _draw(seed, 0, mats, _factor_dtype(leaves, mats))
            q = tuple(_place_q(x, m) for x, m in zip(q, mats, strict=True))
        return PowerSGDState(
            residual=residual, q=q, count=jnp.int32(0), stats=comm_stats.empty_stats()
        )

    def update(updates, state, params=None):
        del params
        whole, treedef = jax.tree.flatten(updates)
        comm.check_dtypes(whole)
        bound = comm.bind()
        bound.check_local(updates)
        stack = stacks.get(per_device.plain_structure(updates), _stacks.Stacks(()))
        leaves = stack.expand(whole)
        mats = matrices(updates, leaves)
        dtype = _factor_dtype(leaves, mats)
        residual = per_device.local(state.residual) if error_feedback else ()

        def dense_step():
            reduced, payload, count = _mean_in_buckets(leaves, range(len(leaves)), bound)
            return reduced, residual, state.q, jnp.float32(payload), jnp.int32(count)

        def compressed_step():
            out, new_residual, q, payload, count = _power_step(
                leaves, residual, state, seed, mats, dtype, bound, error_feedback
            )
            # The two branches of the cond must agree on which values vary
            # per device; state carried as varying (one row per device) stays so.
            q = q if warm_start else ()
            new_residual, q = _vary_like((new_residual, q), (residual, state.q))
            return out, new_residual, q, jnp.float32(payload), count

        if not mats:
            branch = dense_step()
        elif start_step == 0:
            branch = compressed_step()
        else:
            branch = jax.lax.cond(state.count < start_step, dense_step, compressed_step)
        out, new_residual, q, payload, count = branch
        out = jax.tree.unflatten(treedef, stack.collapse(out) if stack.counts else out)
        nonfinite = comm_stats.any_nonfinite(out)

        dense_payload = sum(
            bound.payload_bytes(int(np.size(x)), jnp.result_type(x)) for x in leaves
        )
        stats = comm_stats.CommStats(
            payload_bytes=payload,
            bytes_sent=bound.bytes_sent(payload),
            collectives=jnp.int32(count),
            density=payload / dense_payload if dense_payload else jnp.float32(1),
            nonfinite=nonfinite,
        )
        new = PowerSGDState(
            residual=per_device.as_row(new_residual, comm.axes) if error_feedback else (),
            q=q,
            count=state.count + 1,
            stats=stats,
        )
        # A non-finite step leaves no trace: the flag is the same on every
        # device (the result is), so all of them keep their state.
        kept = state._replace(stats=stats)
        new = jax.tree.map(lambda a, b: jnp.where(nonfinite, a, b), kept, new)
        return out, new

    return optax.GradientTransformation(init, _in_shards.in_shards(update, comm.axes))


def _check_options(rank, start_step, min_compression_rate, error_feedback, warm_start, seed, mask):
    """Every option of :func:`powersgd` that ``reduction`` does not check
    (a callable ``mask`` only once it has a tree to answer for)."""
    if rank is not None:
        rank = _validate.check_positive_integer("rank", rank)
    start_step = _validate.check_count("start_step", start_step)
    if not _validate.is_real(min_compression_rate):
        raise TypeError(f"min_compression_rate={min_compression_rate!r} must be a number")
    min_compression_rate = _validate.check_positive("min_compression_rate", min_compression_rate)
    _validate.check_flag("error_feedback", error_feedback)
    _validate.check_flag("warm_start", warm_start)
    seed = _validate.check_count("seed", seed)
    if isinstance(mask, str):
        if mask != "auto":
            raise ValueError(f"mask={mask!r} must be 'auto', None, a pytree of bools or a callable")
    elif mask is not None and not callable(mask):
        _check_mask_leaves(mask, "mask")
    return rank, start_step, min_compression_rate, seed


def _check_mask_leaves(mask, what: str):
    """Every leaf of `mask` a bool, or a TypeError naming the first that is not."""
    for path, flag in jax.tree_util.tree_leaves_with_path(mask):
        _validate.check_flag(f"{what}{jax.tree_util.keystr(path)}", flag)


def _allowed(mask, tree, layout=None) -> list[bool] | None:
    """Per leaf of `tree`, in tree order: may it be compressed? None: all may.
    `layout` (per leaf, from :func:`_layout`) gives sharded leaves' whole shapes."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "auto"
        shapes = [shape for shape, _ in layout] if layout is not None else None
        return _auto_mask(shapes or [np.shape(x) for x in jax.tree.leaves(tree)])
    if callable(mask):
        mask = mask(tree)
        _check_mask_leaves(mask, "mask(...)")
    try:
        # A mask leaf covers the whole subtree of `tree` at its place.
        flags = jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub), mask, tree)
    except ValueError as e:
        raise ValueError(
            f"powersgd: mask's structure {jax.tree.structure(mask)} is not the gradients' "
            f"or a prefix of it ({jax.tree.structure(tree)})"
        ) from e
    return [bool(f) for f in jax.tree.leaves(flags)]


def _auto_mask(shapes) -> list[bool]:
    """mask="auto": False for a matrix whose first dimension is no dimension of
    any other matrix (an embedding table's vocabulary, a position table's
    context, a first layer's input features), where there are two matrices or
    more; True for every other leaf. Hidden widths recur across layers; the
    axis a table is indexed along does not, and its gradient (one outer
    product per token) is far from low rank."""
    matrices = [i for i, s in enumerate(shapes) if len(s) >= 2]
    allowed = [True] * len(shapes)
    if len(matrices) < 2:
        return allowed
    for i in matrices:
        others = {d for j in matrices if j != i for d in shapes[j]}
        allowed[i] = shapes[i][0] in others
    return allowed


def _rank_of(rank: int | None, rows: int, cols: int) -> int:
    """The rank a `rows` x `cols` matrix is compressed at."""
    if rank is None:
        rank = max(1, min(rows, cols) // DEFAULT_RANK_DIVISOR)
    return min(rank, rows, cols)


def _vary_like(new, old):
    """`new` typed as varying over every axis its counterpart in `old` varies over."""

    def one(x, like):
        missing = tuple(sorted(set(varying_axes(like)) - set(varying_axes(x))))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, new, old)


def _layout(x, spec) -> tuple:
    """(whole shape, mesh axes of each dimension) of a param placed with
    `spec` (:func:`per_device.declared_specs`; None: not split)."""
    spec = spec or (None,) * len(np.shape(x))
    return tuple(np.shape(x)), tuple(per_device.spec_axes(e) for e in spec)


def _matrices(
    leaves, rank: int | None, min_compression_rate: float, allowed, layout=None
) -> list[_Matrix]:
    """The leaves worth compressing (and `allowed`, unless None), in tree
    order, with their matrix views. `layout` (from :func:`_layout`, per
    leaf) gives the whole shapes of sharded leaves; a leaf split over a
    dimension past its second is averaged densely, as its local columns
    would not be one block of the matrix's."""
    if layout is None:
        layout = [(np.shape(x), ()) for x in leaves]
    ok = [
        (allowed is None or allowed[i]) and not any(axes[2:]) for i, (_, axes) in enumerate(layout)
    ]
    out = []
    for i, rows, cols, r in _compression_plan(
        [shape for shape, _ in layout], rank, min_compression_rate, ok
    ):
        axes = layout[i][1]
        row_axes, col_axes = (axes[0], axes[1]) if axes else ((), ())
        out.append(_Matrix(i, rows, cols, r, row_axes, col_axes))
    return out


def _compression_plan(shapes, rank, min_compression_rate: float, allowed) -> list[tuple]:
    """The compression rule: (index, rows, cols, rank) of each leaf of
    ``ndim >= 2`` that `allowed` lets through (None: all) and whose factors
    are ``min_compression_rate`` times smaller than it."""
    out = []
    for i, shape in enumerate(shapes):
        if len(shape) < 2 or (allowed is not None and not allowed[i]):
            continue
        rows, cols = shape[0], math.prod(shape[1:])
        r = _rank_of(rank, rows, cols)
        if (rows + cols) * r * min_compression_rate <= rows * cols:
            out.append((i, rows, cols, r))
    return out


def compressed_matrices(
    shapes, *, rank: int | None = None, min_compression_rate: float = 2.0, mask="auto"
) -> list[tuple[int, int, int, int]]:
    """Which leaves :func:`powersgd` compresses, and how, from their shapes alone.

    The rule :func:`powersgd` applies (its docstring); ``jaxcomm.costmodel``
    prices PowerSGD with it.

    Args:
      shapes: every leaf's whole shape, in tree order.
      rank, min_compression_rate: as :func:`powersgd`'s.
      mask: ``"auto"``, ``None``, or one bool per leaf (False keeps it dense).

    Returns:
      ``(leaf index, rows, cols, rank)`` of each compressed leaf, in tree order.

    Examples:
      >>> from jaxcomm.transforms.powersgd import compressed_matrices
      >>> compressed_matrices([(256, 64), (64,), (64, 64), (64, 10)])  # 256: an embedding
      [(2, 64, 64, 16), (3, 64, 10, 2)]
      >>> compressed_matrices([(256, 64), (64, 64)], rank=4, mask=None)
      [(0, 256, 64, 4), (1, 64, 64, 4)]
    """
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if mask is None:
        allowed = None
    elif isinstance(mask, str):
        if mask != "auto":
            raise ValueError(f"mask={mask!r}: use 'auto', None or one bool per leaf")
        allowed = _auto_mask(shapes)
    else:
        allowed = [bool(m) for m in mask]
        if len(allowed) != len(shapes):
            raise ValueError(f"mask has {len(allowed)} entries for {len(shapes)} shapes")
    return _compression_plan(shapes, rank, min_compression_rate, allowed)


def _layer_specs(specs, stack) -> list:
    """Each expanded leaf's spec: a stacked leaf's layers have its spec
    without the layer axis."""
    out = []
    for spec, n in zip(specs, stack.counts or [0] * len(specs), strict=True):
        out += [spec[1:] if spec else spec] * n if n else [spec]
    return out


def _warn_dense(params, whole, stack, layout, mats, mask, rank, rate: float) -> None:
    """At init: where no leaf is compressed, says so (every step would send
    the whole gradient densely); and names each leaf of 3 or more dimensions
    sent dense that no metadata or option said stacks layers (the usual
    sign of layers stacked by nnx.vmap or nn.scan, which compress per layer)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if not mats:
        allowed = _allowed(mask, params, layout)
        if allowed is not None and not isinstance(mask, str):
            allowed = stack.repeat(allowed)
        _warn_nothing_compressed(stack.repeat(paths), layout, allowed, mask, rank, rate)
        return
    compressed = {m.leaf for m in mats}
    i = 0
    for path, x, n in zip(paths, whole, stack.counts or [0] * len(whole), strict=True):
        if not n and np.ndim(x) >= 3 and i not in compressed:
            warnings.warn(
                f"powersgd: params{path} of shape {tuple(np.shape(x))} is sent dense: as one "
                f"{np.shape(x)[0]} x {math.prod(np.shape(x)[1:])} matrix it does not compress. "
                "If its first axis stacks layers (nnx.vmap, nnx.scan, nn.scan), say so with "
                "stacked= (a pytree of bools, as mask) or name that axis 'layers' in its "
                "partitioning metadata, and each layer is compressed",
                stacklevel=4,
            )
        i += n or 1


def _warn_nothing_compressed(paths, layout, allowed, mask, rank, rate: float) -> None:
    """Says so at init where no leaf is compressed: every step would then send
    the whole gradient densely, and nothing else would show it but the stats."""
    i = max(range(len(paths)), key=lambda j: math.prod(layout[j][0]))
    shape = layout[i][0]
    if allowed is not None and not allowed[i]:
        why = (
            "mask='auto' keeps it dense: its first dimension is no other matrix's (an "
            "embedding's); pass mask=None to compress it"
            if isinstance(mask, str)
            else "mask keeps it dense"
        )
    elif len(shape) < 2:
        why = "it is not matrix-shaped (ndim < 2)"
    elif any(layout[i][1][2:]):
        why = "it is split over the mesh past its second dimension"
    else:
        rows, cols = shape[0], math.prod(shape[1:])
        r = _rank_of(rank, rows, cols)
        why = (
            f"as a {rows} x {cols} matrix its rank-{r} factors, {(rows + cols) * r} "
            f"elements, are not min_compression_rate={rate:g} times smaller than its "
            f"{rows * cols}"
        )
    warnings.warn(
        f"powersgd: no gradient leaf is compressed, so every step sends the whole gradient "
        f"densely. A leaf is compressed where it is matrix-shaped and (rows + cols) * rank * "
        f"min_compression_rate <= rows * cols (rank={rank}, min_compression_rate={rate:g}); "
        f"the largest leaf, params{paths[i]} of shape {tuple(shape)}, is not: {why}.",
        stacklevel=3,
    )


def _place_q(q, m: _Matrix):
    """A warm-start Q of `m`, split over the mesh axes of m's columns where
    init runs under a mesh (its rows are the matrix's columns)."""
    return per_device.place(q, jax.sharding.PartitionSpec(m.col_axes or None))


def _block(x, axes: tuple, size: int):
    """This device's block of `size` rows of `x`, split over mesh `axes`."""
    if not axes:
        return x
    start = jax.lax.axis_index(axes) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)


def _factor_dtype(leaves, mats):
    """float64 when a compressed leaf is, float32 otherwise (16-bit leaves too)."""
    wide = any(np.dtype(jnp.result_type(leaves[m.leaf])).itemsize > 4 for m in mats)
    return jnp.float64 if wide else jnp.float32


def _draw(seed: int, step, mats, dtype) -> tuple:
    """The standard normal Q of every matrix for `step`, the same on every device."""
    total = sum(m.cols * m.rank for m in mats)
    key = jax.random.fold_in(jax.random.key(seed), step)
    flat = jax.random.normal(key, (total,), jnp.float32).astype(dtype)
    return tuple(_flat.split(flat, [(m.cols, m.rank) for m in mats]))


def _start_q(state, seed: int, mats, dtype, ms) -> list:
    """This step's Q: the last one (zero columns drawn afresh) or a fresh
    draw; of a matrix with split columns, the rows of this device's columns
    (`ms`: the local matrices)."""
    fresh = _draw(seed, state.count, mats, dtype)
    fresh = [_block(f, m.col_axes, mm.shape[1]) for f, m, mm in zip(fresh, mats, ms, strict=True)]
    if not state.q:
        return list(fresh)
    return [jnp.where(jnp.all(q == 0, axis=0), f, q) for q, f in zip(state.q, fresh, strict=True)]


def _power_step(leaves, residual, state, seed, mats, dtype, bound, error_feedback: bool):
    """One compressed step: (result leaves, new residuals, new Q, payload
    bytes, collectives).

    A matrix split over other mesh axes (a sharded model) is compressed
    shard by shard: P = M Q summed over the axes of its columns, Q = M^T P
    over those of its rows (sums of r columns), and P's columns made
    orthonormal from P gathered over the axes of its rows (rows x r, a
    fraction r/cols of the matrix); each device sends its own rows of P and
    of Q over the reduced axes.
    """
    ms = [leaves[m.leaf].reshape(np.shape(leaves[m.leaf])[0], -1).astype(dtype) for m in mats]
    q0 = _start_q(state, seed, mats, dtype, ms)
    if error_feedback:
        ms = [mm + e.reshape(mm.shape).astype(dtype) for mm, e in zip(ms, residual, strict=True)]
    compressed = {m.leaf for m in mats}
    out, payload, count = _mean_in_buckets(
        leaves, [i for i in range(len(leaves)) if i not in compressed], bound
    )

    ps = [
        over_shards.psum(jnp.matmul(mm, q, precision=_PRECISION), m.col_axes)
        for mm, q, m in zip(ms, q0, mats, strict=True)
    ]
    ps = bound.allreduce_bucket(ps)
    ps = [_orthonormal_rows_block(p, m.row_axes) for p, m in zip(ps, mats, strict=True)]
    qs = [
        over_shards.psum(jnp.matmul(mm.T, p, precision=_PRECISION), m.row_axes)
        for mm, p, m in zip(ms, ps, mats, strict=True)
    ]
    qs = bound.allreduce_bucket(qs)
    payload += sum(bound.payload_bytes(p.size + q.size, dtype) for p, q in zip(ps, qs, strict=True))

    new_residual = []
    for m, mm, p, q in zip(mats, ms, ps, qs, strict=True):
        approx = jnp.matmul(p, q.T, precision=_PRECISION)
        leaf = leaves[m.leaf]
        out[m.leaf] = approx.reshape(jnp.shape(leaf)).astype(jnp.result_type(leaf))
        if error_feedback:
            new_residual.append((mm - approx).reshape(jnp.shape(leaf)).astype(leaf.dtype))
    return out, tuple(new_residual) if error_feedback else (), tuple(qs), payload, count + 2


def _orthonormal_columns(p):
    """P's columns made orthonormal left to right: Gram-Schmidt's result,
    computed as a QR decomposition (Householder), which stays orthogonal to
    rounding error when the columns are nearly dependent, as warm-started
    ones become. R's diagonal is made positive; where it is 0 (a column
    that is a combination of the earlier ones, e.g. a zero gradient) the
    column is zero rather than an arbitrary direction."""
    q, r = jnp.linalg.qr(p)
    diagonal = jnp.diagonal(r)
    return q * jnp.where(diagonal < 0, -1, 1).astype(q.dtype) * (diagonal != 0).astype(q.dtype)


def _orthonormal_rows_block(p, axes: tuple):
    """:func:`_orthonormal_columns` of P whose rows are split over `axes`:
    this device's rows of the result."""
    if not axes:
        return _orthonormal_columns(p)
    whole = over_shards.all_gather(p, axes)
    return _block(_orthonormal_columns(whole), axes, p.shape[0])


def _mean_in_buckets(leaves, indices, bound):
    """The mean of leaves[indices] in one collective per dtype; returns (all
    leaves, the reduced ones replaced; payload bytes; collectives)."""
    indices = list(indices)
    reduced, payload, count = reduce_in_buckets([leaves[i] for i in indices], bound, math.inf)
    out = list(leaves)
    for i, x in zip(indices, reduced, strict=True):
        out[i] = x
    return out, payload, count
