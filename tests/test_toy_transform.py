"""The worked example of docs/contributing.md (tests/toy_transform.py) against a
NumPy float64 reference; tests/catalog.py runs it through every other style."""

import jax
import numpy as np
import optax
from harness import mesh_of, random_grads, run_as_users_do

import jaxcomm
from tests.toy_transform import scaled_sign

SHAPES = {"w": (5, 3), "b": (3,)}


def reference(grads_seq):
    """Each step's mean of the devices' scaled signs, and the residuals left."""
    residual = {k: np.zeros((8, *s)) for k, s in SHAPES.items()}
    means = []
    for g in grads_seq:
        mean = {}
        for k in SHAPES:
            corrected = g[k].astype(np.float64) + residual[k]
            axes = tuple(range(1, corrected.ndim))
            sent = np.sign(corrected) * np.abs(corrected).mean(axis=axes, keepdims=True)
            residual[k] = corrected - sent
            mean[k] = sent.mean(axis=0)
        means.append(mean)
    return means, residual


def test_scaled_sign_against_numpy_every_step():
    mesh = mesh_of((8,), ("data",))
    grads_seq = random_grads(np.random.default_rng(0), SHAPES, 8, steps=4)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    tx = optax.chain(scaled_sign("data"), optax.sgd(1.0))
    updates, _, state = run_as_users_do(tx, params, grads_seq, mesh)
    means, residual = reference(grads_seq)
    for got, want in zip(updates, means, strict=True):
        for k in SHAPES:  # sgd(1.0): the update is minus the mean
            np.testing.assert_allclose(-got[k], want[k], rtol=1e-5, atol=1e-6)
    for k in SHAPES:
        np.testing.assert_allclose(
            np.asarray(state[0].residual.value[k]), residual[k], rtol=1e-4, atol=1e-5
        )
    stats = jaxcomm.get_stats(state)
    # backend='auto' on CPU is XLA's, which leaves fusion to XLA: a call per leaf.
    assert int(stats.collectives) == len(SHAPES)
    assert float(stats.payload_bytes) == 4 * (5 * 3 + 3)
    specs = jaxcomm.state_specs(state, "data")[0].residual.value
    assert specs == {"w": jax.P("data"), "b": jax.P("data")}
