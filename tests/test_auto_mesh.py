"""A model sharded by jit's propagation over Auto mesh axes, as Flax's guides
write it: its own sharding constraints, partitioning metadata, and jaxcomm's
exchange run on each device's shards (never in XLA's partitioned region).

The references are the same program under ``nnx.jit`` (float32, the gradient
XLA reduces) and NumPy float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests import hlo

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
LR = 0.1


class MLP(nnx.Module):
    """Flax's sharding guide's shape: params with partitioning metadata, a
    constraint naming the data axis on the activations."""

    def __init__(self, rngs, constrain=None):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(nnx.with_partitioning(init, (None, "model"))(rngs.params(), (8, 16)))
        self.b1 = nnx.Param(jnp.zeros((16,)))
        self.w2 = nnx.Param(nnx.with_partitioning(init, ("model", None))(rngs.params(), (16, 2)))
        self.constrain = constrain

    def __call__(self, x):
        y = jax.nn.relu(x @ self.w1 + self.b1)
        if self.constrain is None:  # the guide's spelling, looked up as it runs
            y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        else:
            y = self.constrain(y, P("data", "model"))
        return y @ self.w2


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    y = rng.normal(size=(16, 2)).astype(np.float32)
    put = lambda a: jax.device_put(a, NamedSharding(MESH, P("data")))  # noqa: E731
    return put(x), put(y)


def _build(tx, **kw):
    with jax.set_mesh(MESH):
        model = MLP(nnx.Rngs(0), **kw)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _specs(tree):
    """Each leaf's placement, one entry per dimension."""
    return [
        tuple(v.sharding.spec) + (None,) * (v.ndim - len(v.sharding.spec))
        for v in jax.tree.leaves(nnx.state(tree))
    ]


@jaxcomm.data_parallel
def _dp_step(model, optimizer, x, y):
    loss, grads = jaxcomm.value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


def test_constraints_on_the_data_axis_keep_working_and_shardings_are_kept():
    """The model's own P("data", "model") constraint runs unchanged; the
    steps equal nnx.jit's, and params and moments keep their placements."""
    x, y = _data()

    @nnx.jit
    def jit_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    model, opt = _build(optax.adam(LR))
    jm, jo = _build(optax.chain(jaxcomm.allreduce_gradients("data"), optax.adam(LR)))
    before = _specs(jm), _specs(jo.opt_state)
    with jax.set_mesh(MESH):
        for _ in range(3):
            want = float(jit_step(model, opt, x, y))
            got = float(_dp_step(jm, jo, x, y))
            np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(jm)), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    after = _specs(jm), _specs(jo.opt_state)
    assert after == before
    assert (None, "model") in before[0] and ("model", None) in before[1]


def test_a_constraint_imported_by_name_is_said_in_jaxcomms_words():
    """`from jax.lax import with_sharding_constraint` escapes jaxcomm's
    handling: the error names the construct and the fix, before the step
    runs, and the next program runs in the same process."""
    from jax._src.pjit import with_sharding_constraint as by_name

    x, y = _data()
    model, opt = _build(
        optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(LR)), constrain=by_name
    )
    with jax.set_mesh(MESH), pytest.raises(ValueError, match=r"constraint.*names the data axis"):
        _dp_step(model, opt, x, y)
    # The process goes on: the same program written the guide's way runs.
    model, opt = _build(optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(LR)))
    with jax.set_mesh(MESH):
        assert np.isfinite(float(_dp_step(model, opt, x, y)))


def test_per_device_rows_get_a_row_axis_in_flax_metadata():
    """diloco's rows of a param annotated (None, "model") are annotated
    ("data", None, "model") (and ("model", None)'s ("data", "model", None)),
    so nnx.Optimizer places them (it raised IndivisibleError when the rows
    inherited the param's names)."""
    tx = jaxcomm.diloco(optax.adam(LR), optax.sgd(0.7), "data", sync_every=2)
    model, opt = _build(tx)
    rows = nnx.state(opt.opt_state)
    specs = {
        jax.tree_util.keystr(p): v.sharding.spec
        for p, v in jax.tree_util.tree_leaves_with_path(rows)
        if v.ndim == 3
    }
    want = {"w1": P("data", None, "model"), "w2": P("data", "model", None)}
    assert specs and all(s == want[p.split("'")[-2]] for p, s in specs.items()), specs


def test_bf16_wire_matches_numpy_and_sends_each_devices_shards_only():
    """bf16 wire under data_parallel: one step against NumPy float64 (mean
    of the per-device gradients rounded to bf16), and the compiled step's
    cross-data all-reduces carry local shards (w1: 8 x 16/4), never a whole
    leaf."""
    x, y = _data()
    tx = optax.chain(
        jaxcomm.allreduce_gradients("data", wire_dtype="bfloat16", backend="xla"), optax.sgd(LR)
    )
    model, opt = _build(tx)
    w1, b1, w2 = (np.asarray(v, np.float64) for v in (model.w1[...], model.b1[...], model.w2[...]))
    with jax.set_mesh(MESH):
        compiled = hlo.program(_dp_step.lower(model, opt, x, y).compile())
        sent = [
            a
            for i in hlo.collectives(compiled)
            if hlo.replica_groups(i) == "{{0,4},{1,5},{2,6},{3,7}}"
            for a in i.arrays
        ]
        _dp_step(model, opt, x, y)

    def grads(xs, ys):
        h = xs @ w1 + b1
        a = np.maximum(h, 0)
        d = 2 * (a @ w2 - ys) / ys.size
        dh = (d @ w2.T) * (h > 0)
        return xs.T @ dh, dh.sum(0), a.T @ d

    bf16 = lambda g: np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64)  # noqa: E731
    xs, ys = np.asarray(x, np.float64), np.asarray(y, np.float64)
    per_device = [grads(xs[i * 8 : (i + 1) * 8], ys[i * 8 : (i + 1) * 8]) for i in range(2)]
    want = [
        p - LR * np.mean([bf16(g[k]) for g in per_device], 0) for k, p in enumerate((w1, b1, w2))
    ]
    for got, w in zip((model.w1[...], model.b1[...], model.w2[...]), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), w, rtol=2e-2, atol=2e-3)
    # Over "data" (devices {i, i + 4}): w1 (8, 16) and w2 (16, 2) split over
    # "model" (4) go as shards of 32 and 8 elements, b1 whole (16).
    assert sent and max(a.elements for a in sent) <= 32, sent
    assert sum(a.elements for a in sent) < (8 * 16 + 16 + 16 * 2) / 2, sent


def test_a_partly_auto_shard_map_exchanges_and_the_process_goes_on():
    """A user's own jit(shard_map(..., axis_names={"data"})) over a mesh whose
    "model" axis is Auto: XLA aborted the process on the narrowed wire (ffi
    and xla). Now the update runs manual over "model" too, with a warning
    saying it exchanges whole copies; the result equals NumPy's, and a
    second, good program then runs in the same process."""
    w = np.random.default_rng(1).normal(size=(16, 32)).astype(np.float32)
    xs = np.random.default_rng(2).normal(size=(8, 16)).astype(np.float32)
    for backend in ("ffi", "xla"):
        tx = jaxcomm.allreduce_gradients("data", wire_dtype="bfloat16", backend=backend)
        with jax.set_mesh(MESH):
            params = {"w": jax.device_put(w, NamedSharding(MESH, P(None, "model")))}
            state = tx.init(params)
            specs = jaxcomm.state_specs(state, "data", axis_names={"data"})

            def step(params, state, x, tx=tx):
                loss = lambda p: jnp.sum(jnp.tanh(x @ p["w"]))  # noqa: E731
                g = jaxcomm.grad(loss, "data")(params)
                return tx.update(g, state, params)[0]

            run = jax.jit(
                jax.shard_map(
                    step,
                    in_specs=(P(), specs, P("data")),
                    out_specs=P(),
                    axis_names={"data"},
                )
            )
            x = jax.device_put(xs, NamedSharding(MESH, P("data")))
            with pytest.warns(UserWarning, match="exchanges whole copies"):
                got = np.asarray(run(params, state, x)["w"])
        halves = [xs[:4].astype(np.float64), xs[4:].astype(np.float64)]
        per = [h.T @ (1 - np.tanh(h @ w) ** 2) for h in halves]
        bf16 = lambda g: np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64)  # noqa: E731
        np.testing.assert_allclose(got, np.mean([bf16(g) for g in per], 0), rtol=2e-2, atol=1e-2)
    test_constraints_on_the_data_axis_keep_working_and_shardings_are_kept()


def test_powersgd_on_a_matrix_split_to_one_column_per_device():
    """An (8, 4) matrix split over its columns on a (data=2, fsdp=4) mesh
    (one column per device), jit with an Explicit fsdp axis: PowerSGD at
    its full rank (4) is the dense mean, against NumPy float64."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    tx = optax.chain(jaxcomm.powersgd("data", rank=4, min_compression_rate=0.1), optax.sgd(LR))
    xs = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    with jax.set_mesh(mesh):
        params = {
            "w": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P(None, "fsdp")))
        }
        state = tx.init(params)
        specs = jaxcomm.state_specs(state, "data", axis_names={"data"})

        def loss(p, x):
            return jnp.sum(jnp.tanh(jnp.matmul(x, p["w"], out_sharding=P(None, None))))

        def step(p, s, x):
            u, s = tx.update(jaxcomm.local_grad(loss, "data")(p, x), s, p)
            return optax.apply_updates(p, u)

        run = jax.jit(
            jax.shard_map(
                step,
                in_specs=({"w": P()}, specs, P("data")),
                out_specs={"w": P()},
                axis_names={"data"},
            )
        )
        got = np.asarray(
            run(params, state, jax.device_put(xs, NamedSharding(mesh, P("data"))))["w"]
        )
    halves = [xs[:2].astype(np.float64), xs[2:].astype(np.float64)]
    grads = [h.T @ (1 - np.tanh(h @ np.ones((8, 4))) ** 2) for h in halves]
    np.testing.assert_allclose(got, 1 - LR * np.mean(grads, 0), rtol=1e-5)
