"""A backend is one class: defined here, in a test, it plugs into
``jaxcomm.allreduce`` and ``jaxcomm.allreduce_gradients`` without a line of
library code changed. And the classes jaxcomm resolves itself."""

import numpy as np
import optax
import pytest
from jax import lax

import jaxcomm
from jaxcomm.collectives import Backend, Wire, XlaBackend, backends, reduction
from tests.harness import mesh_of, optax_on_mean, random_grads, run_sharded, run_steps


class CountingBackend(XlaBackend):
    """XLA's collectives, counting the allreduces traced."""

    name = "counting"

    def __init__(self):
        self.calls = 0

    def allreduce(self, bound, flat, **options):
        self.calls += 1
        return super().allreduce(bound, flat, **options)


class PsumOnly(Backend):
    """The least a backend implements for a dense allreduce: one method."""

    name = "psum-only"

    def allreduce(self, bound, flat, *, in_place=False, parts=None):
        _, prescale, postscale = bound.scales(flat.dtype)
        return lax.psum(flat * prescale, bound.place.axes) * postscale


def test_toy_backend_runs_allreduce():
    toy = CountingBackend()
    xs = np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32)
    got = run_sharded(
        lambda x: jaxcomm.allreduce(x, "i", op="mean", backend=toy), mesh_of((8,), ("i",)), xs
    )
    np.testing.assert_allclose(got, np.broadcast_to(xs.mean(0), got.shape), rtol=1e-6)
    assert toy.calls == 1


@pytest.mark.parametrize("make", [CountingBackend, PsumOnly], ids=["counting", "psum-only"])
def test_toy_backend_runs_allreduce_gradients(make):
    """Three steps of SGD against plain optax on the float64 mean gradient."""
    toy = make()
    params = {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}
    grads = random_grads(np.random.default_rng(1), {"w": (3, 4), "b": (4,)}, 8, 3)
    tx = optax.chain(jaxcomm.allreduce_gradients("i", backend=toy), optax.sgd(0.1))
    _, got, state = run_steps(tx, params, grads, mesh_of((8,), ("i",)))
    want, _ = optax_on_mean(optax.sgd(0.1), params, grads)
    for k in params:
        np.testing.assert_allclose(got[k][0], want[k], rtol=1e-5, atol=1e-6)
    # One collective per leaf (xla's default buckets), as the stats count them.
    assert int(jaxcomm.get_stats(state).collectives[0]) == 2
    if isinstance(toy, CountingBackend):
        assert toy.calls == 2  # two leaves, one trace of the step


def test_toy_backend_options_are_checked_when_built():
    with pytest.raises(ValueError, match="algorithm='ring' is not one of backend 'psum-only'"):
        jaxcomm.allreduce_gradients("i", backend=PsumOnly(), algorithm="ring")


def test_backend_without_an_operation_says_which():
    toy = PsumOnly()
    xs = np.ones((2, 8), np.float32)
    with pytest.raises(NotImplementedError, match="backend 'psum-only' has no masked allreduce"):
        run_sharded(
            lambda x: jaxcomm.allreduce(
                x, "i", backend=toy, chunk_mask=np.ones(2, bool), chunk_size=4
            ),
            mesh_of((2,), ("i",)),
            xs,
        )


@pytest.mark.parametrize(
    "name,masked,wire,want",
    [
        ("xla", False, None, "XlaCpuBackend"),
        ("auto", False, None, "XlaCpuBackend"),
        ("auto", True, None, "CpuFfiBackend"),
        ("auto", False, "bfloat16", "CpuFfiBackend"),
        ("auto", False, "float8_e4m3fn", "XlaCpuBackend"),
        ("ffi", False, None, "CpuFfiBackend"),
    ],
)
def test_names_resolve_to_one_class_each_on_cpu(name, masked, wire, want):
    """One process on CPU with the extension: what 'auto' picks, in one place."""
    got = backends.resolve(name, masked=masked, wire=Wire.of(wire))
    assert type(got).__name__ == want
    assert got.name == ("xla" if want.startswith("Xla") else "ffi")


def test_bound_reduction_reports_its_backend():
    def body(x):
        bound = reduction("i", wire_dtype="float16").bind()
        assert (bound.backend.name, bound.algorithm) == ("ffi", "direct")
        return x

    run_sharded(body, mesh_of((2,), ("i",)), np.ones((2, 1), np.float32))
