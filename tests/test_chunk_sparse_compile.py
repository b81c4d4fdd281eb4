"""Compiling a chunk_sparse step: nothing pool- or chunk-sized is a compile-time
constant, so XLA has nothing large to constant-fold (a fold that takes over a
second prints a slow-operation alarm at every compile and adds to its time)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.harness import mesh_of

N = 8
SHAPES = {"w": (300, 512), "b": (512,)}  # 154,112 elements: 2,408 chunks of 64
# Literal arrays in the optimized HLO: "s32[4]{0} constant({...})".
CONSTANT = re.compile(r"= \w+\[([\d,]*)\][^ ]* constant\(")
LARGEST_CONSTANT = 64  # elements; a chunk table or an element mask is thousands


def _compiled_step(backend: str, wire_dtype, donate=()):
    mesh = mesh_of((N,), ("data",))
    tx = jaxcomm.chunk_sparse(
        optax.sgd(0.05, momentum=0.9),
        "data",
        density=0.1,
        chunk_size=64,
        warmup_steps=3,
        wire_dtype=wire_dtype,
        backend=backend,
    )
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def step(p, s, g):
        updates, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, updates), s

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)),
        donate_argnums=donate,
    )
    grads = {
        k: jax.ShapeDtypeStruct((N, *s), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        for k, s in SHAPES.items()
    }
    return run.lower(params, state, grads).compile()


@pytest.mark.parametrize("backend,wire_dtype", [("xla", jnp.float16), ("ffi", None)])
def test_a_step_compiles_without_large_constants(capfd, backend, wire_dtype):
    text = _compiled_step(backend, wire_dtype).as_text()
    sizes = [
        int(np.prod([int(d) for d in m.group(1).split(",") if d])) for m in CONSTANT.finditer(text)
    ]
    assert sizes, "no constants found: the pattern no longer matches XLA's HLO text"
    assert max(sizes) <= LARGEST_CONSTANT, sorted(sizes)[-5:]
    assert "Constant folding" not in capfd.readouterr().err


@pytest.mark.skipif(not jaxcomm.ffi_available("cpu"), reason="jaxcomm's CPU handlers not built")
def test_a_donated_residual_is_written_in_place():
    """With the state donated, as a training loop does, the next residual is
    written into the old one's buffer (jaxcomm_chunk_residual aliases it): no
    copy of a pool-sized array anywhere in the step, which the handler
    without the alias needed (its result copied into the donated buffer)."""
    pool = sum(int(np.prod(s)) for s in SHAPES.values())
    text = _compiled_step("ffi", None, donate=(1,)).as_text()
    entry = text[text.index("ENTRY") :]
    copies = re.findall(r"= f32\[([\d,]*)\][^ ]* copy\(", entry)
    assert not [c for c in copies if np.prod([int(d) for d in c.split(",")]) == pool], copies
    assert "jaxcomm_chunk_residual" in entry and "output_to_operand_aliasing" in entry
