"""The model's own sharding constraints, kept working inside a data-parallel step.

A model written for ``jit`` over a ``("data", "model")`` mesh may constrain its
activations: ``jax.lax.with_sharding_constraint(y, P("data", "model"))``, or the
same through Flax (``nn.with_logical_constraint``, NNX ``out_sharding=``).
Inside :func:`jaxcomm.data_parallel` the data axis is manual (each device runs
its own rows of the batch), and JAX refuses a constraint that names a manual
axis. What such a constraint says about the data axis is already true there (a
device holds only its rows), so :func:`over_model_axes` drops the data axis from
every constraint and reshard while the step is traced, and keeps the rest (the
activations stay split over "model" as the model asked). This is what libraries
that wrap their kernels in ``shard_map`` do with the constraints inside them.

JAX has no hook for this, so the two public functions Flax and user code call,
``jax.lax.with_sharding_constraint`` and ``jax.sharding.reshard``, are replaced
while a step is traced (and only then; a context variable scopes the change to
the tracing thread). A model that imported the function by name
(``from jax.lax import with_sharding_constraint``) bypasses the replacement;
:func:`data_parallel` then says so in its error.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_DROPPED: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_dropped_axes", default=None)
_LOCK = threading.Lock()
_ORIGINAL: dict = {}  # the functions replaced, while any step is traced
_USERS = [0]


def without_axes(spec: P, axes: frozenset) -> P:
    """`spec` with the mesh axes `axes` removed from every entry."""

    def entry(e):
        if e is None or e is P.UNCONSTRAINED:
            return e
        kept = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a not in axes)
        if not kept:
            return None
        return kept if isinstance(e, tuple) else kept[0]

    return P(*map(entry, spec), unreduced=spec.unreduced, reduced=spec.reduced)


def _strip(shardings, axes):
    def one(s):
        if isinstance(s, P):
            return without_axes(s, axes)
        if isinstance(s, NamedSharding):
            return s.update(spec=without_axes(s.spec, axes))
        return s

    return jax.tree.map(one, shardings, is_leaf=lambda s: isinstance(s, (P, NamedSharding)))


def _all_explicit_but(axes) -> bool:
    """Are the context mesh's axes other than `axes` all Explicit? (Then a
    constraint is an assertion, as under jit on an all-Explicit mesh.)"""
    mesh = jax.sharding.get_abstract_mesh()
    others = [t for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if n not in axes]
    return bool(others) and all(t == jax.sharding.AxisType.Explicit for t in others)


def _with_sharding_constraint(x, shardings):
    axes = _DROPPED.get()
    if axes is None:
        return _ORIGINAL["with_sharding_constraint"](x, shardings)
    shardings = _strip(shardings, axes)
    if _all_explicit_but(axes):
        return _ORIGINAL["reshard"](x, shardings)
    return _ORIGINAL["with_sharding_constraint"](x, shardings)


def _reshard(xs, out_shardings):
    axes = _DROPPED.get()
    if axes is not None:
        out_shardings = _strip(out_shardings, axes)
    return _ORIGINAL["reshard"](xs, out_shardings)


@contextlib.contextmanager
def over_model_axes(axis: str):
    """Inside the block, sharding constraints and reshards traced by this
    thread ignore mesh axis `axis` (the step's manual data axis)."""
    with _LOCK:
        if not _USERS[0]:
            _ORIGINAL["with_sharding_constraint"] = jax.lax.with_sharding_constraint
            _ORIGINAL["reshard"] = jax.sharding.reshard
            jax.lax.with_sharding_constraint = _with_sharding_constraint
            jax.sharding.reshard = _reshard
        _USERS[0] += 1
    token = _DROPPED.set(frozenset({axis}))
    try:
        yield
    finally:
        _DROPPED.reset(token)
        with _LOCK:
            _USERS[0] -= 1
            if not _USERS[0]:
                jax.lax.with_sharding_constraint = _ORIGINAL.pop("with_sharding_constraint")
                jax.sharding.reshard = _ORIGINAL.pop("reshard")
