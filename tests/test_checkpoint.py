"""Checkpoints lose nothing: every jaxcomm state (error-feedback residuals,
double buffers, chunk masks and residuals, step counters, the inner
optimizer's state, the stats) saves and restores with Orbax, and a run that
stops after 10 steps and resumes in a new process ends after 20 steps
bitwise equal to an uninterrupted run, for every option.

This process runs the uninterrupted 20 steps and the first 10 (then saves);
one subprocess restores every option's checkpoint and runs the last 10."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.harness import mesh_of, random_grads, run_steps

STEPS, STOP = 20, 10
SHAPES = {"a_bias": (5,), "b_kernel": (33, 17), "c_scalar": (), "d_odd": (301,)}
ROOT = Path(__file__).resolve().parent.parent

# name -> (mesh shape, axis names, transform factory). Together they cover
# every option of both transforms.
OPTIONS = {
    "fp16_error_feedback_adam": (
        (8,),
        ("data",),
        lambda a: optax.chain(
            jaxcomm.allreduce_gradients(a, wire_dtype=jnp.float16, error_feedback=True),
            optax.adam(1e-2),
        ),
    ),
    "ffi_fp16_error_feedback_double_buffering": (
        (8,),
        ("data",),
        lambda a: optax.chain(
            jaxcomm.allreduce_gradients(
                a,
                backend="ffi",
                wire_dtype=jnp.float16,
                error_feedback=True,
                double_buffering=True,
            ),
            optax.sgd(0.05, momentum=0.9),
        ),
    ),
    "double_buffering_unfused_bf16": (
        (8,),
        ("data",),
        lambda a: optax.chain(
            jaxcomm.allreduce_gradients(
                a, wire_dtype=jnp.bfloat16, bucket_bytes=0, double_buffering=True
            ),
            optax.adam(1e-2),
        ),
    ),
    "ffi_ring_fused": (
        (8,),
        ("data",),
        lambda a: optax.chain(
            jaxcomm.allreduce_gradients(a, backend="ffi", algorithm="ring", bucket_bytes=math.inf),
            optax.adamw(1e-2),
        ),
    ),
    "xla_ring_sum_fp16_buckets": (
        (8,),
        ("data",),
        lambda a: optax.chain(
            jaxcomm.allreduce_gradients(
                a,
                backend="xla",
                algorithm="ring",
                op="sum",
                wire_dtype=jnp.float16,
                bucket_bytes=1024,
            ),
            optax.sgd(0.01, momentum=0.9),
        ),
    ),
    "hierarchical_ffi_bf16_error_feedback": (
        (2, 4),
        ("node", "local"),
        lambda a: optax.chain(
            jaxcomm.allreduce_gradients(
                a,
                algorithm="hierarchical",
                backend="ffi",
                wire_dtype=jnp.bfloat16,
                error_feedback=True,
            ),
            optax.adam(1e-2),
        ),
    ),
    "hierarchical_xla_double_buffering": (
        (2, 4),
        ("node", "local"),
        lambda a: optax.chain(
            jaxcomm.allreduce_gradients(
                a, algorithm="hierarchical", backend="xla", double_buffering=True
            ),
            optax.sgd(0.05, momentum=0.9),
        ),
    ),
    # The buffer, each device's predicted params, AdamW's state and counter.
    "double_buffered_adamw_fp16_ffi": (
        (8,),
        ("data",),
        lambda a: jaxcomm.double_buffered(
            optax.adamw(1e-2), a, wire_dtype=jnp.float16, error_feedback=True, backend="ffi"
        ),
    ),
    # warm-up of 15 steps: the checkpoint falls in the middle of the ramp.
    "chunk_sparse_adam_warmup_ffi": (
        (8,),
        ("data",),
        lambda a: jaxcomm.chunk_sparse(
            optax.adam(1e-2), a, density=0.25, chunk_size=16, warmup_steps=15, backend="ffi"
        ),
    ),
    "chunk_sparse_momentum_xla_fp16": (
        (8,),
        ("data",),
        lambda a: jaxcomm.chunk_sparse(
            optax.sgd(0.05, momentum=0.9),
            a,
            density=0.3,
            chunk_size=32,
            warmup_steps=4,
            residual_decay=0.8,
            wire_dtype=jnp.float16,
            backend="xla",
        ),
    ),
}


def _setup(name):
    shape, axes, factory = OPTIONS[name]
    mesh = mesh_of(shape, axes)
    tx = factory(axes if len(axes) > 1 else axes[0])
    rng = np.random.default_rng(1)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = random_grads(np.random.default_rng(2), SHAPES, mesh.size, STEPS)
    return mesh, tx, params, grads


def _resume_steps(tx, params_rows, state_rows, grads_seq, mesh):
    """The loop of harness.run_steps, started from a given params
    and state (one row per device, as run_steps returns them)."""
    spec = P(tuple(mesh.axis_names))
    put = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec)), tree
    )
    unrow = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
    rows = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731

    def step(p, state, g):
        p, state, g = unrow(p), unrow(state), unrow(g)
        updates, state = tx.update(g, state, p)
        return rows(optax.apply_updates(p, updates)), rows(state), rows(updates)

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
    p, state, updates = put(params_rows), put(state_rows), []
    for g in grads_seq:
        p, state, u = jax.block_until_ready(run(p, state, put(g)))
        updates.append(jax.tree.map(np.asarray, u))
    return updates, jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, state)


def _template(tx, params, mesh):
    """(params, state) shaped like run_steps' outputs: what a new process
    builds from its own code to restore into (zero steps: init only)."""
    _, p, state = run_steps(tx, params, [], mesh)
    return p, state


def _save(path: Path, tree):
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, tree)


def _restore(path: Path, template):
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, template)


def resume_all(directory: Path):
    """In the new process: restore each option's checkpoint, run the last
    steps, and save what they produced for the parent to compare."""
    for name in OPTIONS:
        mesh, tx, params, grads = _setup(name)
        template = _template(tx, params, mesh)
        p, state = _restore(directory / name / "step10", template)
        updates, p, state = _resume_steps(tx, p, state, grads[STOP:], mesh)
        _save(directory / name / "resumed", {"params": p, "state": state, "updates": updates})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per option: the uninterrupted run, and the resumed one read back."""
    directory = tmp_path_factory.mktemp("checkpoints")
    straight = {}
    for name in OPTIONS:
        mesh, tx, params, grads = _setup(name)
        straight[name] = run_steps(tx, params, grads, mesh)
        _, p, state = run_steps(tx, params, grads[:STOP], mesh)
        _save(directory / name / "step10", (p, state))
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    code = (
        "import pathlib; from tests.test_checkpoint import resume_all; "
        f"resume_all(pathlib.Path({str(directory)!r}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = {}
    for name in OPTIONS:
        mesh, tx, params, grads = _setup(name)
        p, state = _template(tx, params, mesh)
        updates = [jax.tree.map(np.zeros_like, p) for _ in range(STEPS - STOP)]
        got = _restore(
            directory / name / "resumed", {"params": p, "state": state, "updates": updates}
        )
        resumed[name] = got
    return straight, resumed


def _assert_bitwise(got, want, what):
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def, f"{what}: tree structure {got_def} != {want_def}"
    for path_and_leaf, g in zip(jax.tree_util.tree_leaves_with_path(want), got_leaves, strict=True):
        path, w = path_and_leaf
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}{jax.tree_util.keystr(path)}"
        assert g.tobytes() == w.tobytes(), (
            f"{what}{jax.tree_util.keystr(path)} differs after resuming"
        )


@pytest.mark.parametrize("name", list(OPTIONS))
def test_resume_in_a_new_process_is_bitwise_equal(checkpoints, name):
    straight, resumed = checkpoints
    updates, params, state = straight[name]
    got = resumed[name]
    _assert_bitwise(got["params"], params, "params")
    _assert_bitwise(got["state"], state, "state")
    _assert_bitwise(got["updates"], updates[STOP:], "updates")
