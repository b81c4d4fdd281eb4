"""Checkpoints lose nothing: every jaxcomm state (error-feedback residuals,
double buffers, chunk masks and residuals, PowerSGD's factors, DiLoCo's local
params, step counters, the inner optimizer's state, the stats) saves and
restores with Orbax, and a run that stops after STOP steps and resumes from the
checkpoint ends after STEPS steps bitwise equal to an uninterrupted run, for
every configuration in tests/catalog.py.

Each configuration's step is compiled once and runs the uninterrupted STEPS,
keeping the params and state after STOP. The fast test saves those, restores
them into a template that init builds, and runs the last steps with the same
compiled step. The slow test resumes in a new process: one subprocess restores
every configuration's checkpoint, compiles the step anew and runs the last
steps."""

from __future__ import annotations

import functools
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

from tests.catalog import BY_NAME, CATALOG, ids
from tests.harness import mesh_of, random_grads

# STOP falls inside a warm-up ("chunk_sparse ffi warmup" ramps for 4 steps),
# after PowerSGD's start (step 2) and between two DiLoCo syncs (every 2).
STEPS, STOP = 6, 3
SHAPES = {"a_bias": (5,), "b_kernel": (33, 17), "c_scalar": (), "d_odd": (301,)}
ROOT = Path(__file__).resolve().parent.parent
EVERY = pytest.mark.parametrize("config", CATALOG, ids=ids(CATALOG))


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


class _Runner:
    """harness.run_steps' loop (one row per device for every array) with init
    and the step compiled once, so that a run can start from any params and
    state, such as a restored checkpoint."""

    def __init__(self, name: str):
        config = BY_NAME[name]
        self.mesh = mesh_of(config.mesh, config.axes)
        self.tx = tx = config.make()
        rng = np.random.default_rng(1)
        self.params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        self.grads = random_grads(np.random.default_rng(2), SHAPES, self.mesh.size, STEPS)
        self.spec = spec = P(config.axes)
        unrow = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        rows = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731

        def step(p, state, g):
            p, state, g = unrow(p), unrow(state), unrow(g)
            updates, state = tx.update(g, state, p)
            return rows(optax.apply_updates(p, updates)), rows(state), rows(updates)

        def init(p):
            return rows(tx.init(unrow(p)))

        shard = functools.partial(jax.shard_map, mesh=self.mesh, in_specs=spec, out_specs=spec)
        self._step, self._init = jax.jit(shard(step)), jax.jit(shard(init))

    def put(self, tree):
        sharding = NamedSharding(self.mesh, self.spec)
        return jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), sharding), tree)

    def start(self):
        """(params, state) before the first step, as NumPy rows: the template
        a process builds from its own code to restore into."""
        n = self.mesh.size
        p = jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), self.params)
        return _numpy(p), _numpy(jax.block_until_ready(self._init(self.put(p))))

    def run(self, p, state, grads_seq, keep_after=None):
        """(updates per step, params, state), and the (params, state) after
        `keep_after` steps."""
        p, state, updates, kept = self.put(p), self.put(state), [], None
        for g in grads_seq:
            p, state, u = jax.block_until_ready(self._step(p, state, self.put(g)))
            updates.append(_numpy(u))
            if len(updates) == keep_after:
                kept = _numpy((p, state))
        return updates, _numpy(p), _numpy(state), kept


@functools.cache
def _runner(name: str) -> _Runner:
    return _Runner(name)


@functools.cache
def _straight(name: str):
    """The uninterrupted run: (updates, params, state), and (params, state) after STOP."""
    runner = _runner(name)
    updates, p, state, at_stop = runner.run(*runner.start(), runner.grads, keep_after=STOP)
    return (updates, p, state), at_stop


def _save(path: Path, tree):
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, tree)


def _restore(path: Path, template):
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, template)


def _resume(name: str, checkpoint: Path):
    """Restores `checkpoint` into the template and runs the steps after STOP."""
    runner = _runner(name)
    p, state = _restore(checkpoint, runner.start())
    updates, p, state, _ = runner.run(p, state, runner.grads[STOP:])
    return {"params": p, "state": state, "updates": updates}


def resume_all(directory: Path):
    """In the new process: restore each configuration's checkpoint, run the
    last steps, and save what they produced for the parent to compare."""
    for config in CATALOG:
        resumed = _resume(config.name, directory / config.name / "stop")
        _save(directory / config.name / "resumed", resumed)


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


def _assert_resumed_like_straight(got, name):
    (updates, params, state), _ = _straight(name)
    _assert_bitwise(got["params"], params, "params")
    _assert_bitwise(got["state"], state, "state")
    _assert_bitwise(got["updates"], updates[STOP:], "updates")


@EVERY
def test_resume_from_a_checkpoint_is_bitwise_equal(config, tmp_path):
    _, at_stop = _straight(config.name)
    _save(tmp_path / "stop", at_stop)
    _assert_resumed_like_straight(_resume(config.name, tmp_path / "stop"), config.name)


@pytest.fixture(scope="module")
def resumed_in_a_new_process(tmp_path_factory):
    """Per configuration: the run resumed in a new process, read back."""
    directory = tmp_path_factory.mktemp("checkpoints")
    for config in CATALOG:
        _save(directory / config.name / "stop", _straight(config.name)[1])
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
    for config in CATALOG:
        p, state = _runner(config.name).start()
        updates = [jax.tree.map(np.zeros_like, p) for _ in range(STEPS - STOP)]
        resumed[config.name] = _restore(
            directory / config.name / "resumed", {"params": p, "state": state, "updates": updates}
        )
    return resumed


@pytest.mark.slow
@EVERY
def test_resume_in_a_new_process_is_bitwise_equal(resumed_in_a_new_process, config):
    _assert_resumed_like_straight(resumed_in_a_new_process[config.name], config.name)
