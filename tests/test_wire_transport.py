"""What the compiled program sends, and which path 'auto' takes, the way users call it.

- A 16-bit wire travels as 16 bits: XLA's CPU compiler widens a bfloat16
  collective-permute or all-gather to float32, so the xla ring moves the bits
  (uint16). Checked in the compiled HLO, not in what we meant to send.
- Across processes on CPU, ``algorithm="auto"`` with a 16-bit wire is the ring
  (gloo adds float16 slowly; a bfloat16 psum is widened to float32).
- ``backend="auto"`` takes ffi for a 16-bit wire in one CPU process, and
  never lowers to a jaxcomm custom call on GPU.
- ``chunk_sparse(backend="xla")``, 8-bit wires and a one-device mesh work
  with ``out_specs=P()``, as the README writes the step.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import hlo

N = 8


def _mesh():
    return jax.make_mesh((N,), ("data",))


def _allreduce_fn(mesh, backend="xla", **opts):
    def f(x):
        return jaxcomm.allreduce(x * 1.0, "data", op="mean", backend=backend, **opts)

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))


@functools.cache
def _ring_fn(wire):
    """The ring's program for a wire, shared by the tests that read it and run it."""
    return _allreduce_fn(_mesh(), algorithm="ring", wire_dtype=wire)


def _sharded_input(mesh, n_per_device: int, seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((N, n_per_device)).astype(np.float32)
    return x, jax.device_put(x.reshape(-1), NamedSharding(mesh, P("data")))


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_ring_sends_16_bits_per_element(wire):
    n = 4096
    _, x = _sharded_input(_mesh(), n)
    found = hlo.collectives(hlo.compiled(_ring_fn(wire), x))
    assert found, "no collective in the compiled step"
    # N-1 permutes of one chunk (n/N elements) and one all-gather of n.
    permutes = [c for c in found if c.collective == "collective-permute"]
    gathers = [c for c in found if c.collective == "all-gather"]
    assert len(permutes) == N - 1 and len(gathers) == 1, found
    for c in found:
        assert c.dtypes <= {"u16", "f16", "bf16"}, f"{c.collective} carries {c.dtypes}: {found}"
    assert all(c.elements == n // N for c in permutes) and gathers[0].elements == n


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_ring_16_bit_result_matches_float64_within_the_wire_bound(wire):
    xs, x = _sharded_input(_mesh(), 4096, seed=1)  # the size read above: its program
    got = np.asarray(_ring_fn(wire)(x), np.float64)
    want = xs.astype(np.float64).mean(0)
    # Each value is rounded to the wire once per hop (N-1 hops of partial
    # sums, one for the gathered result): relative rounding 2^-8 (bfloat16)
    # or 2^-11 (float16) per rounding, of values at most sum|x_i|/N.
    eps = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[wire]
    bound = N * eps * np.abs(xs).astype(np.float64).mean(0) + 1e-7
    assert np.all(np.abs(got - want) <= bound)
    # The bits matter: a wrong bitcast gives garbage far outside the bound.
    assert np.max(np.abs(got - want)) > 0


def test_allreduce_gradients_stats_match_the_compiled_bytes():
    """payload_bytes counts what this device puts into its collectives: with
    a bfloat16 wire on the ring, that is 2 bytes a gradient element, which is
    what the compiled permutes and all-gather carry."""
    mesh = _mesh()
    tx = jaxcomm.allreduce_gradients("data", wire_dtype="bfloat16", algorithm="ring", backend="xla")
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    state = tx.init(params)

    def step(p, s, g):
        upd, s = tx.update(jax.tree.map(lambda a: a[0], g), s, p)
        return upd, s

    grads = jax.tree.map(lambda a: jnp.ones((N, *a.shape)), params)
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )
    compiled = f.lower(params, state, grads).compile()
    found = hlo.collectives(compiled)
    gathered = sum(c.elements for c in found if c.collective == "all-gather")
    assert set().union(*(c.dtypes for c in found)) == {"u16"}, found
    _, state = jax.block_until_ready(compiled(params, state, grads))  # the program read
    stats = jaxcomm.get_stats(state)
    elements = sum(a.size for a in jax.tree.leaves(params))
    assert gathered == elements  # every element is gathered once, in 2 bytes
    assert float(stats.payload_bytes) == 2 * elements


def test_auto_is_the_ring_for_a_16_bit_wire_across_processes(monkeypatch):
    mesh = _mesh()
    _, x = _sharded_input(mesh, 256)

    def ops(**opts):
        return {c.collective for c in hlo.collectives(hlo.compiled(_allreduce_fn(mesh, **opts), x))}

    assert ops(wire_dtype="bfloat16") == {"all-reduce"}  # one process: lax.psum
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert ops(wire_dtype="bfloat16") == {"collective-permute", "all-gather"}
    assert ops(wire_dtype="float16") == {"collective-permute", "all-gather"}
    assert ops() == {"all-reduce"}  # float32 stays with gloo's psum


def _paths(f, x) -> tuple[set, set]:
    """(jaxcomm custom calls in the lowering, what communicates in the compiled
    step: XLA's collectives and jaxcomm's)."""
    lowered = f.lower(x)
    calls = {c.target for c in hlo.custom_calls(lowered) if c.target.startswith("jaxcomm")}
    return calls, {c.collective for c in hlo.collectives(lowered.compile())}


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_auto_takes_ffi_for_a_16_bit_wire_in_one_cpu_process(monkeypatch, wire):
    """XLA's CPU all-reduce adds float16 in float16 (and widens bfloat16 to
    float32); ffi adds in float32. float32 stays with lax.psum, and across
    processes a 16-bit wire takes the xla ring."""
    mesh = _mesh()
    xs, x = _sharded_input(mesh, 1000, seed=2)
    f = _allreduce_fn(mesh, "auto", wire_dtype=wire)
    assert _paths(f, x) == ({"jaxcomm_allreduce"}, {"jaxcomm_allreduce"})
    assert _paths(_allreduce_fn(mesh, "auto"), x) == (set(), {"all-reduce"})
    # The result: each input rounded to the wire once (after the 1/N
    # prescale) and the float32 sum rounded to the wire once more, for any
    # N: a float16 psum's error would grow with N instead.
    got = np.asarray(f(x), np.float64)  # the program read, compiled once
    want = xs.astype(np.float64).mean(0)
    eps = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[wire]
    bound = 2 * eps * np.abs(xs).astype(np.float64).mean(0) + 1e-7
    assert np.all(np.abs(got - want) <= bound)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    calls, ops = _paths(_allreduce_fn(mesh, "auto", wire_dtype=wire), x)
    assert not calls and ops == {"collective-permute", "all-gather"}
    monkeypatch.undo()  # one process again, on a GPU as far as 'auto' can tell
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not _paths(_allreduce_fn(mesh, "auto", wire_dtype=wire), x)[0]


def test_backend_auto_never_lowers_to_a_custom_call_on_gpu(monkeypatch):
    """Until the CUDA handlers have run across GPUs, 'auto' keeps them out.
    The platform is faked at trace time; the lowering is still for CPU, which
    is enough to see which backend was chosen."""
    mesh = _mesh()
    tx = jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.25, chunk_size=16)
    params = {"w": jnp.ones((64,))}
    with jax.set_mesh(mesh):
        state = tx.init(params)
    specs = jaxcomm.state_specs(state, "data")
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def step(p, s, g):
        return tx.update(g, s, p)

    g = jax.device_put(jnp.ones((N * 64,)), NamedSharding(mesh, P("data")))
    args = (params, state, {"w": g})

    def custom_calls():
        f = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
        )
        return [c.target for c in hlo.custom_calls(f.lower(*args))]

    assert any("jaxcomm" in c for c in custom_calls())  # CPU, one process: ffi
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not any("jaxcomm" in c for c in custom_calls())


def _readme_step(tx, loss_fn):
    def step(params, opt_state, x, y):
        local = jax.lax.pcast(params, "data", to="varying")
        grads = jax.grad(loss_fn)(local, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _train(tx, mesh, steps=3):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((40, 30)), jnp.float32), "b": jnp.zeros(30)}
    devices = mesh.devices.size

    def loss_fn(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    with jax.set_mesh(mesh):
        opt_state = tx.init(params)
    specs = jaxcomm.state_specs(opt_state, "data")
    opt_state = jax.device_put(opt_state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    train_step = jax.jit(
        jax.shard_map(
            _readme_step(tx, loss_fn),
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs),
        )
    )
    batch = NamedSharding(mesh, P("data"))
    for _ in range(steps):
        x = jax.device_put(rng.standard_normal((4 * devices, 40)).astype(np.float32), batch)
        y = jax.device_put(rng.standard_normal((4 * devices, 30)).astype(np.float32), batch)
        params, opt_state = jax.block_until_ready(train_step(params, opt_state, x, y))
    return params, opt_state


def test_chunk_sparse_xla_runs_with_replicated_out_specs_and_matches_ffi():
    mesh = _mesh()

    def tx(backend):
        return jaxcomm.chunk_sparse(
            optax.sgd(0.05, momentum=0.9), "data", density=0.2, chunk_size=64, backend=backend
        )

    xla_params, xla_state = _train(tx("xla"), mesh)
    ffi_params, _ = _train(tx("ffi"), mesh)
    for a, b in zip(jax.tree.leaves(xla_params), jax.tree.leaves(ffi_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert float(jaxcomm.get_stats(xla_state).density) < 1


_8_BIT_TXS = {
    "dense": lambda w: optax.chain(
        jaxcomm.allreduce_gradients("data", wire_dtype=w, error_feedback=w is not None),
        optax.sgd(0.05),
    ),
    "sparse": lambda w: jaxcomm.chunk_sparse(
        optax.sgd(0.05), "data", density=0.5, chunk_size=64, wire_dtype=w
    ),
}


@functools.cache
def _trained_on_float32(kind: str):
    """The float32 wire's params after _train, once for both 8-bit wires."""
    return _train(_8_BIT_TXS[kind](None), _mesh())[0]


@pytest.mark.parametrize("wire", ["float8_e4m3fn", "float8_e5m2"])
def test_8_bit_wires_run_the_readme_step_with_replicated_out_specs(wire):
    """backend='auto' takes xla for an 8-bit wire, also under chunk_sparse's
    mask (ffi has none), and the step trains close to the float32 wire."""
    mesh = _mesh()
    for kind, make in _8_BIT_TXS.items():
        params, _ = _train(make(wire), mesh)
        exact = _trained_on_float32(kind)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(exact), strict=True):
            assert np.all(np.isfinite(a))
            # Three steps move w by up to 0.05 and b by 0.01; e5m2 lands within 0.003.
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0.006)


def test_one_device_mesh_with_replicated_out_specs():
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    x = jax.device_put(jnp.arange(6.0), NamedSharding(mesh, P("data")))
    for backend in ("xla", "ffi"):
        f = jax.jit(
            jax.shard_map(
                lambda v, b=backend: jaxcomm.allreduce(v, "data", op="mean", backend=b),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P(),
            )
        )
        np.testing.assert_array_equal(np.asarray(f(x)), np.arange(6.0))
    tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(0.1))
    params, _ = _train(tx, mesh, steps=1)
    assert np.all(np.isfinite(np.asarray(params["w"])))


def test_backend_ffi_on_gpu_is_the_cuda_backend_without_a_warning(monkeypatch):
    """The CUDA handlers have run across processes (tools/gpu_check.sh), so
    choosing them warns of nothing."""
    from jaxcomm.collectives import Wire, _extension, backends

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_extension, "require", lambda platform=None: None)  # no CUDA module here
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend = backends.resolve("ffi", wire=Wire())
    assert isinstance(backend, backends.CudaFfiBackend)
    assert "alltoall" in backend.algorithms
    assert "alltoall" not in backends.CpuFfiBackend.algorithms


@pytest.mark.parametrize(
    "version,platform,processes,warns",
    [("0.10.2", "cpu", 2, True), ("0.12.0", "cpu", 2, False), ("0.10.2", "cpu", 1, False),
     ("0.10.2", "gpu", 2, False)],
)  # fmt: skip
def test_hierarchical_xla_across_cpu_processes_warns_on_older_jaxlib(
    monkeypatch, version, platform, processes, warns
):
    import warnings

    import jaxlib

    from jaxcomm.collectives import Wire
    from jaxcomm.collectives.backends import xla

    monkeypatch.setattr(jaxlib, "__version__", version)
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    xla._warn_hierarchical_wrong_results.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = xla.XlaBackend().algorithm("hierarchical", ("node", "local"), Wire())
    xla._warn_hierarchical_wrong_results.cache_clear()
    assert got == "hierarchical"
    assert any("sometimes" in str(w.message) for w in seen) == warns
