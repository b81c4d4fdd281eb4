"""bench/overlap.py runs (its waiting handlers are registered, called and
return their input) and prints one row per program. Its timings are the
benchmark's to report, not asserted here beyond the waits' own length."""

from __future__ import annotations

import bench_modules
import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _bench():
    return bench_modules.load("overlap")


def test_wait_handlers_return_their_input_after_the_wait():
    testing = pytest.importorskip("jaxcomm._ffi_testing")
    for name, capsule in testing.wait_handlers().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    x = jnp.arange(5.0)
    testing.take_waits()
    for tag, target in enumerate(("jaxcomm_testing_wait", "jaxcomm_testing_wait_async")):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))
        y = call(x, seconds=np.float64(0.01), tag=np.int64(tag))
        np.testing.assert_array_equal(np.asarray(y), np.arange(5.0))
    waits = testing.take_waits()
    assert [w[0] for w in waits] == [0, 1]
    assert all(end - start >= 0.01 for _, start, end in waits)


def test_overlap_bench_prints_every_program(capsys):
    pytest.importorskip("jaxcomm._ffi_testing")
    assert _bench().main(["--wait", "0.01", "--matmuls", "1", "--rounds", "1"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    names = [r[:26].strip() for r in rows]
    assert names == [
        "compute",
        "blocking wait",
        "blocking wait + compute",
        "blocking wait x2",
        "future wait",
        "future wait + compute",
        "future wait x2",
    ]
    # A wait program cannot end before its wait did.
    assert all(float(r[26:36]) >= 0.01 for r in rows if "wait" in r)
