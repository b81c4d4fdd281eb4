"""JAXCOMM_KEEP_HOST_MEMORY=1 keeps host memory mapped between steps
(jaxcomm/_host_memory.py): a chunk-sparse step whose temporaries are above
glibc's mmap threshold does not touch fresh pages every step; without it
(the default) it does. Each case runs in a fresh process, as a user's script
does: the tuning must come before JAX starts its threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource
    import jax, jax.numpy as jnp, numpy as np, optax
    import jaxcomm
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",))
    params = {"w1": np.zeros((1024, 1600), np.float32), "w2": np.zeros((1600, 1600), np.float32)}
    tx = jaxcomm.chunk_sparse(optax.sgd(0.01, momentum=0.9), "d", density=0.15)
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "d")

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("d")),
                                out_specs=(P(), specs)))
    put = lambda tree, specs: jax.tree.map(  # noqa: E731
        lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), tree, specs)
    g = put(jax.tree.map(lambda x: np.ones((1, *x.shape), x.dtype), params),
            {"w1": P("d"), "w2": P("d")})
    p, s = params, put(state, specs)
    for _ in range(40):  # the heap grows to its size over the first steps
        p, s = jax.block_until_ready(run(p, s, g))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        p, s = jax.block_until_ready(run(p, s, g))
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8
    print("kept", jaxcomm._host_memory.keep_host_memory(), "faults", faults)
    """
)


def _faults_per_step(keep: str | None) -> tuple[bool, float]:
    env = {**os.environ, "JAXCOMM_KEEP_HOST_MEMORY": keep or "", "XLA_FLAGS": ""}
    for name in ("GLIBC_TUNABLES",) + (() if keep else ("JAXCOMM_KEEP_HOST_MEMORY",)):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    return words[words.index("kept") + 1] == "True", float(words[words.index("faults") + 1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_step_does_not_fault_its_temporaries_in_again():
    """4.2M parameters: the step's temporaries (pool, exchanged pool, ...) are
    about 4 x 17 MB, one allocation above glibc's 32 MiB mmap threshold.
    Left as it is, malloc maps it afresh every step (a page fault per 4 KiB
    page touched: 12,000-16,000 a step); kept, the heap serves it again
    (none here once the heap has its size; on a loaded machine it has
    taken longer, so the test asks for a fifth of the default's at most)."""
    kept, kept_faults = _faults_per_step("1")
    assert kept
    kept, faults = _faults_per_step(None)  # the default
    assert not kept
    assert faults > 4000, faults
    assert kept_faults < faults / 5, (kept_faults, faults)


def test_asked_too_late_it_says_so():
    """Set, but JAX started before jaxcomm was imported: nothing is tuned,
    and a warning says why and what to do."""
    script = "import jax.numpy as jnp; jnp.ones(2).block_until_ready(); import jaxcomm"
    env = {**os.environ, "JAXCOMM_KEEP_HOST_MEMORY": "1", "XLA_FLAGS": ""}
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "JAXCOMM_KEEP_HOST_MEMORY=1 has no effect" in out.stderr
    assert "import jaxcomm before running anything in JAX" in out.stderr
