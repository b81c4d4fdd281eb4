"""The public API imports and says what it exports, and building the
transforms does not start JAX's backends."""

import subprocess
import sys
import textwrap

import pytest

import jaxcomm


def test_public_api():
    for name in jaxcomm.__all__:
        assert hasattr(jaxcomm, name), name
    assert callable(jaxcomm.allreduce)
    assert jaxcomm.ffi_available("cpu")
    assert not jaxcomm.ffi_available("tpu")


# Builds both transforms with their defaults (backend="auto") and a few
# options, and sets the ffi timeout, then checks that no backend has started, which
# jax.distributed.initialize must precede, and that it indeed still works.
_BUILD_THEN_INITIALIZE = textwrap.dedent(
    """
    import socket

    import jax
    import jax.numpy as jnp
    import optax
    from jax._src import xla_bridge

    import jaxcomm

    jaxcomm.allreduce_gradients("data")
    jaxcomm.allreduce_gradients("data", backend="auto", wire_dtype=jnp.float16, error_feedback=True)
    jaxcomm.allreduce_gradients(("node", "data"), algorithm="hierarchical", backend="ffi")
    jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.1)
    jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.1, backend="auto")
    jaxcomm.double_buffered(optax.adamw(1e-3), "data", wire_dtype=jnp.bfloat16)
    assert not xla_bridge.backends_are_initialized(), "building a transform started a backend"
    jaxcomm.set_ffi_timeout(30)
    assert not xla_bridge.backends_are_initialized(), "set_ffi_timeout started a backend"

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=1,
        process_id=0,
        initialization_timeout=60,
    )
    assert jax.process_count() == 1
    jax.distributed.shutdown()
    print("initialized after building")
    """
)


@pytest.mark.slow
def test_building_transforms_starts_no_backend():
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_THEN_INITIALIZE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialized after building" in proc.stdout
