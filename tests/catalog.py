"""Every jaxcomm configuration the "for every transform" tests run, in one list.

Each entry is one transform with one set of options and the inner optimizer it
drives; ``entry.make(axis_name)`` builds the whole optimizer (the jaxcomm head
chained with, or wrapping, its inner optimizer), and ``make(axis_name, inner)``
the same with another inner optimizer. Together the entries cover every option
of every transform (wire dtypes, error feedback, buckets and fusion, double
buffering, the ring and hierarchical algorithms, both backends, warm-up,
PowerSGD's start, DiLoCo, double_buffered). A new transform or option is one
more line here, and every test that runs the catalog runs it.

The facts tests filter on:

- ``exact``: equals plain optax (``inner``) on the mean gradient, to float32
  rounding, every step.
- ``per_device_state``: the state holds leaves that differ between devices
  (``jaxcomm.state_specs`` shards them over the devices).
- ``gradient_at_local_params``: the gradient must be taken at
  ``jaxcomm.local_params(state)``, each device's own params (diloco,
  double_buffered).
- ``backend``: "xla" or "ffi".
- ``mesh``, ``axes``: the mesh the entry runs on; hierarchical needs two axes.
- ``network``: the bench/network_worker.py configuration that exchanges
  gradients the same way (the transform and its wire options; the bench picks
  its own rank, density, sync interval and inner optimizer), or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import optax

import jaxcomm
from tests.toy_transform import scaled_sign


# The inner optimizers, named so that tests can share a reference run per inner.
def sgd_momentum():
    return optax.sgd(0.1, momentum=0.9)


def slow_sgd_momentum():
    return optax.sgd(0.05, momentum=0.9)


def adam():
    return optax.adam(1e-2)


def adamw():
    return optax.adamw(1e-2)


class Config(NamedTuple):
    name: str
    build: Callable  # build(axis_name, inner) -> the whole optimizer
    inner: Callable  # () -> the inner optimizer
    exact: bool = False
    per_device_state: bool = False
    gradient_at_local_params: bool = False
    backend: str = "xla"
    mesh: tuple = (8,)
    axes: tuple = ("data",)
    network: str | None = None

    @property
    def axis_name(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def make(self, axis_name=None, inner=None) -> optax.GradientTransformation:
        axis = self.axis_name if axis_name is None else axis_name
        return self.build(axis, self.inner() if inner is None else inner)

    def __repr__(self):
        return self.name


def _allreduce(**options):
    return lambda a, inner: optax.chain(jaxcomm.allreduce_gradients(a, **options), inner)


def _chunk_sparse(**options):
    return lambda a, inner: jaxcomm.chunk_sparse(inner, a, **options)


def _powersgd(**options):
    return lambda a, inner: optax.chain(jaxcomm.powersgd(a, **options), inner)


def _diloco(**options):
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)  # the DiLoCo paper's
    return lambda a, inner: jaxcomm.diloco(inner, outer, a, **options)


def _double_buffered(**options):
    return lambda a, inner: jaxcomm.double_buffered(inner, a, **options)


def _scaled_sign(**options):
    return lambda a, inner: optax.chain(scaled_sign(a, **options), inner)


BF16, FP16, FP8 = jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn
HIER = {"mesh": (2, 4), "axes": ("node", "local")}
PER_DEVICE, LOCAL = {"per_device_state": True}, {"gradient_at_local_params": True}

# fmt: off
CATALOG = (
    Config("allreduce", _allreduce(), sgd_momentum, exact=True, network="allreduce"),
    Config("allreduce ffi buckets", _allreduce(backend="ffi", bucket_bytes=256), sgd_momentum,
           exact=True, backend="ffi"),
    Config("allreduce ffi ring fused",
           _allreduce(backend="ffi", algorithm="ring", bucket_bytes=math.inf), adamw,
           exact=True, backend="ffi"),
    Config("allreduce ring sum fp16 buckets",  # op="sum": 8 times the mean, a smaller step
           _allreduce(algorithm="ring", op="sum", wire_dtype=FP16, bucket_bytes=1024),
           lambda: optax.sgd(0.01, momentum=0.9)),
    Config("allreduce bf16", _allreduce(wire_dtype=BF16), sgd_momentum, network="bf16"),
    Config("allreduce bf16 ef", _allreduce(wire_dtype=BF16, error_feedback=True), adam,
           **PER_DEVICE, network="bf16_ef"),
    Config("allreduce fp8 ef", _allreduce(wire_dtype=FP8, error_feedback=True), sgd_momentum,
           **PER_DEVICE, network="fp8_ef"),
    Config("allreduce double buffering", _allreduce(double_buffering=True), sgd_momentum,
           **PER_DEVICE, network="double_buffering"),
    Config("allreduce ffi fp16 ef double buffering unfused",
           _allreduce(backend="ffi", wire_dtype=FP16, error_feedback=True,
                      double_buffering=True, bucket_bytes=0),
           slow_sgd_momentum, **PER_DEVICE, backend="ffi"),
    Config("hierarchical ffi bf16 ef",
           _allreduce(algorithm="hierarchical", backend="ffi", wire_dtype=BF16,
                      error_feedback=True),
           adam, **PER_DEVICE, backend="ffi", **HIER),
    Config("hierarchical double buffering",
           _allreduce(algorithm="hierarchical", backend="xla", double_buffering=True),
           slow_sgd_momentum, **PER_DEVICE, **HIER),
    Config("chunk_sparse", _chunk_sparse(density=0.5, chunk_size=16), sgd_momentum,
           **PER_DEVICE, network="chunk_sparse"),
    Config("chunk_sparse ffi warmup",  # warm-up of 4 steps: still ramping after 3
           _chunk_sparse(density=0.25, chunk_size=16, warmup_steps=4, backend="ffi"), adamw,
           **PER_DEVICE, backend="ffi"),
    Config("chunk_sparse fp16 decay",
           _chunk_sparse(density=0.3, chunk_size=32, warmup_steps=2, residual_decay=0.8,
                         wire_dtype=FP16, backend="xla"),
           slow_sgd_momentum, **PER_DEVICE),
    Config("chunk_sparse density 1", _chunk_sparse(density=1.0, chunk_size=16), sgd_momentum,
           exact=True, **PER_DEVICE),
    Config("powersgd", _powersgd(rank=1, start_step=2, mask=None), sgd_momentum,
           **PER_DEVICE, network="powersgd_r4"),
    Config("diloco", _diloco(sync_every=2), adamw, **PER_DEVICE, **LOCAL, network="diloco_h10"),
    Config("double_buffered bf16", _double_buffered(wire_dtype=BF16), adamw,
           **PER_DEVICE, **LOCAL),
    Config("double_buffered ffi fp16 ef",
           _double_buffered(wire_dtype=FP16, error_feedback=True, backend="ffi"), adamw,
           **PER_DEVICE, **LOCAL, backend="ffi"),
    # The worked example of docs/contributing.md (tests/toy_transform.py).
    Config("toy scaled_sign", _scaled_sign(), slow_sgd_momentum, **PER_DEVICE),
)
# fmt: on
BY_NAME = {c.name: c for c in CATALOG}
assert len(BY_NAME) == len(CATALOG), "two catalog entries share a name"


def select(**facts) -> list[Config]:
    """The entries whose facts equal the given ones: ``select(exact=True)``."""
    return [c for c in CATALOG if all(getattr(c, k) == v for k, v in facts.items())]


def flat() -> list[Config]:
    """The entries that run on one mesh axis of 8 devices."""
    return select(mesh=(8,))


def ids(configs) -> list[str]:
    """pytest ids: the entries' names with "_" for spaces."""
    return [c.name.replace(" ", "_") for c in configs]
