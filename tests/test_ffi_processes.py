"""backend="ffi" across processes on CPU: the handlers reach ranks in other
processes over TCP (xla_ffi/cpu/tcp_transport.h). 2 processes x 2 CPU
devices through ``python -m jaxcomm.launch`` on loopback, checked against
float64 NumPy sums of every device's input; and the TCP transport alone in
the thread harness (ranks as threads of this process, over loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests import reference

ROOT = Path(__file__).resolve().parents[1]

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
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    rows = jax.device_count()
    rng = np.random.default_rng(0)
    ints = rng.integers(-1000, 1000, (rows, 1001)).astype(np.float32)
    reals = rng.normal(size=(rows, 1001)).astype(np.float32)
    mask = np.arange(-(-1001 // 100)) % 3 == 1  # chunks 1, 4, 7, 10 of 100 elements
    sharding = NamedSharding(mesh, P("d"))

    def sharded(a):
        return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

    def per_device(body, a):
        f = jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=P("d"),
                                  out_specs=P("d")))
        y = f(sharded(a))
        return np.stack([np.asarray(s.data)[0] for s in y.addressable_shards])

    out = {}
    for algorithm in ("auto", "ring"):
        for _ in range(2):  # a second call reuses the connections
            out[algorithm] = per_device(
                lambda v: jaxcomm.allreduce(v, "d", backend="ffi", algorithm=algorithm), ints)
    out["float16"] = per_device(
        lambda v: jaxcomm.allreduce(v, "d", backend="ffi", wire_dtype=jnp.float16), reals)
    out["masked"] = per_device(
        lambda v: jaxcomm.allreduce(v, "d", backend="ffi", chunk_mask=jnp.asarray(mask),
                                    chunk_size=100), ints)

    out["reduce_scatter"] = per_device(
        lambda v: jaxcomm.reduce_scatter(v, "d", backend="ffi"), ints)
    out["all_gather"] = per_device(
        lambda v: jaxcomm.all_gather(v, "d", backend="ffi").reshape(-1), ints)

    # One SGD step of a linear model, the gradients reduced by ffi and by xla.
    x_all = rng.normal(size=(rows * 8, 5)).astype(np.float32)
    y_all = rng.normal(size=(rows * 8,)).astype(np.float32)
    params = {"w": jnp.ones((5,)), "b": jnp.zeros(())}

    def trained(backend):
        tx = optax.chain(jaxcomm.allreduce_gradients("d", backend=backend), optax.sgd(0.1))

        def step(p, xb, yb):
            loss = lambda p: jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)  # noqa: E731
            grads = jaxcomm.local_grad(loss, "d")(p)
            updates, _ = tx.update(grads, tx.init(p), p)
            return optax.apply_updates(p, updates)

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                                  out_specs=P()))
        new = f(params, sharded(x_all), sharded(y_all))
        return np.concatenate([np.asarray(new["w"]), np.asarray(new["b"])[None]])

    out["train_ffi"] = trained("ffi")
    out["train_xla"] = trained("xla")

    # DiLoCo with a delayed sync: "auto" starts its exchange over TCP in the
    # sync step and finishes it two steps later; "xla" runs it in the sync step.
    def diloco(backend):
        tx = jaxcomm.diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True), "d",
                            sync_every=4, delay=2, backend=backend)
        p = {"w": np.ones((5,), np.float32), "b": np.zeros((), np.float32)}
        p = jax.tree.map(lambda a: jax.make_array_from_callback(
            a.shape, NamedSharding(mesh, P()), lambda i: a[i]), p)
        with jax.set_mesh(mesh):
            specs = jaxcomm.state_specs(jax.eval_shape(tx.init, p), "d")
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(p)

        def step(p, state, xb, yb):
            loss = lambda q: jnp.mean((xb @ q["w"] + q["b"] - yb) ** 2)  # noqa: E731
            updates, state = tx.update(jax.grad(loss)(jaxcomm.local_params(state)), state, p)
            return optax.apply_updates(p, updates), state

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("d"), P("d")),
                                  out_specs=(P(), specs)))
        xs, ys, in_flight = sharded(x_all), sharded(y_all), []
        for _ in range(8):  # syncs after steps 3 and 7, lands after step 5
            p, state = jax.block_until_ready(f(p, state, xs, ys))
            in_flight.append(_ffi.in_flight())
        return np.concatenate([np.asarray(p["w"]), np.asarray(p["b"])[None]]), in_flight

    from jaxcomm import _ffi

    out["diloco_started"], out["diloco_in_flight"] = diloco("auto")
    out["diloco_xla"], _ = diloco("xla")
    # Double buffering: "auto" starts each step's exchange over TCP as the
    # step ends and the next step finishes it; "xla" reduces the buffer in
    # the next step (gloo). `forget` makes step 2's handles another job's.
    other_job = np.array([1, 0, 0], np.int32)

    def double_buffered(backend, forget=None):
        tx = optax.chain(
            jaxcomm.allreduce_gradients("d", double_buffering=True, backend=backend),
            optax.sgd(0.1))

        def forge(state):
            handles = [np.asarray(h) + other_job for h in state[0].handles]
            return (state[0]._replace(handles=handles), *state[1:])

        return one_step_late(tx, forge if forget else None, forget)

    # chunk_sparse one step late: 3 chunks of 2 elements, 2 of them sent.
    def sparse_late(backend, forget=None):
        tx = jaxcomm.chunk_sparse(optax.sgd(0.1), "d", density=0.5, chunk_size=2,
                                  double_buffering=True, backend=backend)

        def forge(state):
            return state._replace(handle=np.asarray(state.handle) + other_job)

        return one_step_late(tx, forge if forget else None, forget)

    def one_step_late(tx, forge, forget):
        p = {"w": np.ones((5,), np.float32), "b": np.zeros((), np.float32)}
        with jax.set_mesh(mesh):
            state = tx.init(p)
        specs = jaxcomm.state_specs(state, "d")
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(p)
        def step(p, state, xb, yb):
            loss = lambda q: jnp.mean((xb @ q["w"] + q["b"] - yb) ** 2)  # noqa: E731
            updates, state = tx.update(jaxcomm.local_grad(loss, "d")(p), state, p)
            return optax.apply_updates(p, updates), state
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("d"), P("d")),
                                  out_specs=(P(), specs)))
        xs, ys, in_flight, before = sharded(x_all), sharded(y_all), [], _ffi.in_flight()
        for t in range(4):
            if t == forget:
                state = forge(state)
            p, state = jax.block_until_ready(f(p, state, xs, ys))
            in_flight.append(_ffi.in_flight() - before)
        return np.concatenate([np.asarray(p["w"]), np.asarray(p["b"])[None]]), in_flight
    out["db_started"], out["db_in_flight"] = double_buffered("auto")
    out["db_forgotten"], _ = double_buffered("auto", forget=2)
    out["db_xla"], _ = double_buffered("xla")
    out["sparse_started"], out["sparse_in_flight"] = sparse_late("auto")
    out["sparse_forgotten"], _ = sparse_late("auto", forget=2)
    out["sparse_xla"], _ = sparse_late("xla")
    np.savez(f"{sys.argv[1]}-{jax.process_index()}.npz", ints=ints, reals=reals, mask=mask,
             **out)
    print("done", flush=True)
"""

# Process 1 traces the call (so its addresses are published) but never runs it.
MISSING_PEER = """
    import sys
    import time

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm import _ffi, distributed

    distributed.initialize()
    _ffi.set_timeout(2.0)
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    a = np.ones((jax.device_count(), 64), np.float32)
    x = jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("d")), lambda i: a[i])
    f = jax.jit(jax.shard_map(lambda v: jaxcomm.allreduce(v, "d", backend="ffi"), mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
    lowered = f.lower(x)
    if jax.process_index() == 1:
        time.sleep(float(sys.argv[1]))
        sys.exit(0)
    f(x).block_until_ready()
    print("process 0 finished", flush=True)
"""


def _launch(tmp_path: Path, source: str, *args: str, timeout: float = 120):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(source))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "jaxcomm.launch", "-n", "2", "--devices-per-process", "2"]
    return subprocess.run(
        [*command, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ffi-processes")
    result = _launch(tmp_path, WORKER, str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = []
    for process in (0, 1):
        with np.load(tmp_path / f"out-{process}.npz") as f:
            loaded.append(dict(f))
    return loaded


@pytest.mark.slow
def test_allreduce_across_processes_is_the_exact_sum(results):
    for out in results:
        want = out["ints"].astype(np.float64).sum(axis=0)  # small integers: float32 is exact
        for algorithm in ("auto", "ring"):
            assert out[algorithm].shape == (2, 1001)  # this process's two devices
            np.testing.assert_array_equal(out[algorithm], np.broadcast_to(want, (2, 1001)))


@pytest.mark.slow
def test_float16_wire_across_processes_is_within_the_bound(results):
    for out in results:
        reals = out["reals"]
        want = reals.astype(np.float64).sum(axis=0)
        bound = reference.error_bound(reals, "sum", np.float16, np.float32)
        assert np.all(np.abs(out["float16"] - want) <= bound)
        np.testing.assert_array_equal(out["float16"][0], out["float16"][1])


@pytest.mark.slow
def test_chunk_mask_across_processes(results):
    for process, out in enumerate(results):
        ints, mask = out["ints"], out["mask"]
        selected = np.repeat(mask, 100)[: ints.shape[1]]
        total = ints.astype(np.float64).sum(axis=0)
        for local in (0, 1):
            own = ints[2 * process + local]
            np.testing.assert_array_equal(out["masked"][local], np.where(selected, total, own))


@pytest.mark.slow
def test_reduce_scatter_and_all_gather_across_processes(results):
    for process, out in enumerate(results):
        ints = out["ints"]
        total = ints.astype(np.float64).sum(axis=0)
        shard = -(-ints.shape[1] // 4)
        padded = np.concatenate([total, np.zeros(4 * shard - total.size)])
        for local in (0, 1):
            rank = 2 * process + local
            want = padded[rank * shard : (rank + 1) * shard]
            np.testing.assert_array_equal(out["reduce_scatter"][local], want)
            np.testing.assert_array_equal(out["all_gather"][local], ints.reshape(-1))


@pytest.mark.slow
def test_allreduce_gradients_ffi_trains_like_xla(results):
    for out in results:
        # Same mean up to the order of 4 float32 additions: a few ulp of O(1) values.
        np.testing.assert_allclose(out["train_ffi"], out["train_xla"], rtol=0, atol=1e-6)
        assert not np.allclose(out["train_ffi"], [1, 1, 1, 1, 1, 0])  # the step moved


@pytest.mark.slow
def test_a_delayed_diloco_sync_overlaps_steps_across_processes(results):
    """Started in the sync step over TCP, in flight (one per local device)
    through the two steps after it, finished in the landing step: the same
    params as the exchange run inside the sync step (gloo)."""
    for out in results:
        assert list(out["diloco_in_flight"]) == [0, 0, 0, 2, 2, 0, 0, 2]
        np.testing.assert_allclose(out["diloco_started"], out["diloco_xla"], rtol=0, atol=1e-6)
        assert not np.allclose(out["diloco_started"], [1, 1, 1, 1, 1, 0])


@pytest.mark.slow
def test_double_buffering_sends_each_steps_exchange_during_the_next_across_processes(results):
    """Each step starts its buffer's exchange over TCP (one per local device
    and bucket, in flight after it) and the next finishes it: the params of
    the exchange run in the next step (gloo); bitwise those of a run whose
    state lost its handles at step 2 and reduced what it kept."""
    for out in results:
        assert list(out["db_in_flight"]) == [2, 2, 2, 2]
        np.testing.assert_allclose(out["db_started"], out["db_xla"], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(out["db_forgotten"], out["db_started"])
        assert not np.allclose(out["db_started"], [1, 1, 1, 1, 1, 0])


@pytest.mark.slow
def test_chunk_sparse_one_step_late_sends_its_chunks_during_the_next_step_across_processes(
    results,
):
    """chunk_sparse(double_buffering=True) across processes: each step starts
    its masked exchange over TCP (one per local device, in flight after it);
    the params are those of the same run reduced in the step (gloo's masked
    exchange, xla), and bitwise those of a run whose handle was another
    job's at step 2."""
    for out in results:
        assert list(out["sparse_in_flight"]) == [2, 2, 2, 2]
        np.testing.assert_allclose(out["sparse_started"], out["sparse_xla"], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(out["sparse_forgotten"], out["sparse_started"])
        assert not np.allclose(out["sparse_started"], [1, 1, 1, 1, 1, 0])


@pytest.mark.slow
def test_a_process_that_never_joins_is_named_within_the_timeout(tmp_path):
    start = time.monotonic()
    result = _launch(tmp_path, MISSING_PEER, "60", timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.stdout + result.stderr
    assert "process 0 finished" not in result.stdout
    # Rank 0 receives from rank 3 (process 1), rank 1 from rank 0 (which waits).
    assert "rank 3 (127.0.0.1:" in result.stderr, result.stderr
    assert "is not running this collective" in result.stderr or "did not connect" in result.stderr
    assert elapsed < 45, f"the job took {elapsed:.0f} s to end; process 1 sleeps 60 s"


# The thread harness: ranks as threads of this process, over loopback.


def _harness_ring(op_id: int, nranks: int):
    from jaxcomm import _ffi_testing

    ports = [_ffi_testing.tcp_listen(op_id, 0, rank, "127.0.0.1") for rank in range(nranks)]
    _ffi_testing.tcp_set_peers(op_id, 0, [("127.0.0.1", port) for port in ports])
    return _ffi_testing


@pytest.mark.parametrize("algorithm, intra", [(0, 1), (1, 2)], ids=["ring", "hierarchical"])
def test_tcp_transport_in_the_thread_harness(algorithm, intra):
    harness = _harness_ring(0, 4)
    try:
        rng = np.random.default_rng(1)
        xs = [rng.integers(-50, 50, 100_003).astype(np.float32) for _ in range(4)]
        want = np.sum(np.stack(xs).astype(np.float64), axis=0)
        for _ in range(2):
            outs = harness.run_threads(xs, 0, algorithm, -1, 1.0, 1.0, intra, [])
            for out in outs:
                np.testing.assert_array_equal(out, want)
    finally:
        harness.tcp_forget(0)


@pytest.mark.parametrize("algorithm, intra", [(0, 1), (1, 2)], ids=["ring", "hierarchical"])
@pytest.mark.parametrize("n", [3, 1_000_003])
def test_tcp_transport_streams_steps_of_many_segments(algorithm, intra, n):
    """Chunks of ~1 MB stream in 256 KiB segments, each forwarded once added
    (a mean, so the clamp before each send runs too); 3 elements over 4 ranks
    leave empty chunks. Quarters of small integers: exact in float32."""
    harness = _harness_ring(0, 4)
    try:
        rng = np.random.default_rng(2)
        xs = [rng.integers(-50, 50, n).astype(np.float32) for _ in range(4)]
        want = np.sum(np.stack(xs).astype(np.float64), axis=0) * 0.25
        for _ in range(2):
            outs = harness.run_threads(xs, 0, algorithm, -1, 0.25, 1.0, intra, [])
            for out in outs:
                np.testing.assert_array_equal(out, want)
    finally:
        harness.tcp_forget(0)


def test_tcp_transport_names_a_rank_that_never_arrives():
    harness = _harness_ring(0, 4)
    timeout = harness.get_timeout()
    harness.set_timeout(0.5)
    try:
        xs = [np.ones(1000, np.float32) for _ in range(4)]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank [0-3] \(127\.0\.0\.1:\d+\)"):
            harness.run_threads(xs, 0, 0, -1, 1.0, 1.0, 1, [2])
        assert time.monotonic() - start < 5
        # The call site is broken now, and says so instead of mixing up messages.
        with pytest.raises(RuntimeError, match="an earlier call of this call site failed"):
            harness.run_threads(xs, 0, 0, -1, 1.0, 1.0, 1, [])
    finally:
        harness.set_timeout(timeout)
        harness.tcp_forget(0)
