"""The CUDA handlers across processes on one GPU: N processes (``python -m
jaxcomm.launch --one-gpu-each -n N``) share the GPU (or take one each where
there are N), each its own "host" to NCCL
(NCCL_HOSTID), with NCCL's peer-to-peer and shared-memory transports off,
so every byte goes over TCP on loopback as between machines. Every
algorithm (the all-to-all one included) and wire, the masked allreduce,
hierarchical, reduce_scatter / all_gather and a training step are checked
against NumPy sums of every process's input, and every rank must hold the
same bits.

Needs a CUDA GPU and the CUDA module (tools/gpu_check.sh runs it as its own
step); skipped without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]

# Set before JAX (and with it NCCL) starts in each process.
NCCL_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}

# Every process: its own NCCL host id (NCCL would otherwise see one host and
# take shortcuts across processes), then JAX.
PREAMBLE = """
    import os
    os.environ["NCCL_HOSTID"] = "jaxcomm-host-" + os.environ["JAXCOMM_PROCESS_ID"]
"""

WORKER = """
    import sys

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm import distributed

    distributed.initialize()
    n = jax.device_count()
    assert jax.local_device_count() == 1 and jax.devices()[0].platform == "gpu", jax.devices()
    mesh = jax.make_mesh((n,), ("d",))
    rng = np.random.default_rng(0)
    reals = rng.normal(size=(n, 10_001)).astype(np.float32)
    mask = np.arange(-(-10_001 // 512)) % 3 == 1
    spec = P("d")

    def per_device(body, a, m=mesh, s=spec):
        sharding = NamedSharding(m, s)
        x = jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])
        f = jax.jit(jax.shard_map(lambda v: body(v.reshape(-1))[None], mesh=m, in_specs=s,
                                  out_specs=s))
        return np.asarray(f(x).addressable_shards[0].data).reshape(-1)

    out = {}
    for algorithm in ("auto", "ring", "direct", "alltoall"):
        for wire in (None, "bfloat16", "float16"):
            # The mean prescales (and clamps) before the wire; the sum may
            # send the input as it is.
            for op in ("mean", "sum") if algorithm in ("direct", "alltoall") else ("mean",):
                key = f"allreduce/{algorithm}/{wire}/{op}"
                out[key] = per_device(lambda v: jaxcomm.allreduce(
                    v, "d", op=op, algorithm=algorithm, wire_dtype=wire, backend="ffi"), reals)
        for wire in (None, "bfloat16"):
            out[f"masked/{algorithm}/{wire}"] = per_device(lambda v: jaxcomm.allreduce(
                v, "d", algorithm=algorithm, wire_dtype=wire, backend="ffi",
                chunk_mask=jnp.asarray(mask), chunk_size=512, max_chunks=int(mask.sum()),
                unselected="zero"), reals)
    if n % 2 == 0:
        mesh2 = jax.make_mesh((n // 2, 2), ("node", "local"))
        for wire in (None, "bfloat16"):
            out[f"hierarchical/{wire}"] = per_device(
                lambda v: jaxcomm.allreduce(v, ("node", "local"), algorithm="hierarchical",
                                            wire_dtype=wire, backend="ffi"),
                reals, mesh2, P(("node", "local")))
    out["reduce_scatter"] = per_device(
        lambda v: jaxcomm.reduce_scatter(v, "d", backend="ffi"), reals)
    out["all_gather"] = per_device(
        lambda v: jaxcomm.all_gather(v[:100], "d", backend="ffi").reshape(-1), reals)

    # One SGD step of a linear model, the gradients reduced by ffi and by xla.
    x_all = rng.normal(size=(n * 8, 5)).astype(np.float32)
    y_all = rng.normal(size=(n * 8,)).astype(np.float32)

    def trained(backend, algorithm, wire):
        tx = optax.chain(jaxcomm.allreduce_gradients("d", backend=backend, algorithm=algorithm,
                                                     wire_dtype=wire), optax.sgd(0.1))
        params = {"w": jnp.ones((5,)), "b": jnp.zeros(())}

        def step(p, xb, yb):
            loss = lambda p: jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)  # noqa: E731
            grads = jaxcomm.local_grad(loss, "d")(p)
            updates, _ = tx.update(grads, tx.init(p), p)
            return optax.apply_updates(p, updates)

        rows = NamedSharding(mesh, P("d"))
        put = lambda a: jax.make_array_from_callback(a.shape, rows, lambda i: a[i])  # noqa: E731
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                                  out_specs=P()))
        new = f(params, put(x_all), put(y_all))
        return np.concatenate([np.asarray(new["w"]), np.asarray(new["b"])[None]])

    out["train/xla"] = trained("xla", "auto", None)
    for algorithm in ("auto", "ring", "alltoall"):
        out[f"train/ffi/{algorithm}"] = trained("ffi", algorithm, None)
    out["train/ffi/alltoall/bfloat16"] = trained("ffi", "alltoall", "bfloat16")
    np.savez(f"{sys.argv[1]}-{jax.process_index()}.npz", reals=reals, mask=mask, **out)
    print("done", flush=True)
"""


@pytest.fixture(autouse=True)
def _enough_devices():
    """Overrides conftest's 8-device rule: each process brings one device,
    a GPU of its own or the one it shares."""


def _run(tmp_path, processes):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(PREAMBLE) + textwrap.dedent(WORKER))
    env = {**os.environ, **NCCL_ENV}
    env.pop("XLA_FLAGS", None)  # no forced CPU devices: one GPU per process
    env.pop("JAX_PLATFORMS", None)
    run = subprocess.run(
        # One GPU each: the same one on a one-GPU machine, N where there are N.
        [sys.executable, "-m", "jaxcomm.launch", "--one-gpu-each", "-n", str(processes),
         str(script), str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return [dict(np.load(tmp_path / f"out-{p}.npz")) for p in range(processes)]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}procs")
def results(request, tmp_path_factory):
    import jax

    if not jax.devices("gpu"):
        pytest.skip("needs a GPU")
    return request.param, _run(tmp_path_factory.mktemp(f"procs{request.param}"), request.param)


def _keys(outs, prefix):
    return sorted(k for k in outs[0] if k.startswith(prefix))


def _same_everywhere(outs, key):
    for o in outs[1:]:
        assert o[key].tobytes() == outs[0][key].tobytes(), key


def test_allreduce_every_algorithm_and_wire_matches_numpy(results):
    n, outs = results
    exact = outs[0]["reals"].astype(np.float64).sum(0)
    keys = _keys(outs, "allreduce/")
    assert len(keys) == 4 * 3 + 2 * 3
    for key in keys:
        _, _, wire, op = key.split("/")
        want = exact / n if op == "mean" else exact
        tol = 1e-5 if wire == "None" else 2e-2
        np.testing.assert_allclose(outs[0][key], want, rtol=tol, atol=tol * 3, err_msg=key)
        _same_everywhere(outs, key)


def test_masked_allreduce_sums_only_the_selected_chunks(results):
    n, outs = results
    reals, mask = outs[0]["reals"], outs[0]["mask"]
    selected = np.repeat(mask, 512)[: reals.shape[1]]
    want = np.where(selected, reals.astype(np.float64).sum(0), 0.0)
    keys = _keys(outs, "masked/")
    assert len(keys) == 8
    for key in keys:
        tol = 1e-5 if key.endswith("None") else 2e-2
        np.testing.assert_allclose(outs[0][key], want, rtol=tol, atol=tol * 3, err_msg=key)
        _same_everywhere(outs, key)


def test_hierarchical_reduce_scatter_and_all_gather(results):
    n, outs = results
    reals = outs[0]["reals"]
    exact = reals.astype(np.float64).sum(0)
    for key in _keys(outs, "hierarchical/"):
        tol = 1e-5 if key.endswith("None") else 2e-2
        np.testing.assert_allclose(outs[0][key], exact, rtol=tol, atol=tol * 3, err_msg=key)
        _same_everywhere(outs, key)
    assert len(_keys(outs, "hierarchical/")) == (2 if n % 2 == 0 else 0)
    shard = -(-reals.shape[1] // n)
    for p, o in enumerate(outs):
        mine = exact[p * shard : (p + 1) * shard]
        np.testing.assert_allclose(o["reduce_scatter"][: len(mine)], mine, rtol=1e-5, atol=3e-5)
        np.testing.assert_array_equal(o["all_gather"], reals[:, :100].reshape(-1))


def test_training_step_ffi_matches_xla(results):
    n, outs = results
    for key in _keys(outs, "train/ffi/"):
        tol = 2e-2 if key.endswith("bfloat16") else 1e-5
        np.testing.assert_allclose(outs[0][key], outs[0]["train/xla"], rtol=tol, atol=tol)
        _same_everywhere(outs, key)
