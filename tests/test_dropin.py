"""jaxcomm dropped into programs written for jit: Flax's data-parallel NNX toy,
the NNX MNIST tutorial's CNN (BatchNorm, Dropout, MultiMetric) and a Linen
TrainState program (examples/flax_dropin/). Each converted program is run
against its plain-jit original: losses, params, BatchNorm statistics and
metrics must match; the conversions must stay within 5 changed lines, and
docs/dropin.md must show them as they are."""

from __future__ import annotations

import difflib
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from example_modules import load
from flax import nnx
from jax import lax

import jaxcomm

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "flax_dropin"
PAIRS = ("toy", "cnn", "linen")


def _diff(name: str) -> list[str]:
    original = (EXAMPLES / f"{name}_jit.py").read_text().splitlines()
    converted = (EXAMPLES / f"{name}_jaxcomm.py").read_text().splitlines()
    return list(
        difflib.unified_diff(
            original, converted, f"{name}_jit.py", f"{name}_jaxcomm.py", n=1, lineterm=""
        )
    )


@pytest.mark.parametrize("name", PAIRS)
def test_the_conversion_is_at_most_five_lines(name):
    body = [line for line in _diff(name)[2:] if not line.startswith("@@")]
    added = [line for line in body if line.startswith("+") and line[1:].strip()]
    removed = [line for line in body if line.startswith("-") and line[1:].strip()]
    assert 0 < len(added) <= 5 and len(removed) <= 5, "\n".join(body)


@pytest.mark.parametrize("name", PAIRS)
def test_docs_show_the_conversion_as_it_is(name):
    docs = (ROOT / "docs" / "dropin.md").read_text()
    assert "\n".join(_diff(name)) in docs, f"regenerate {name}'s diff in docs/dropin.md"


def test_toy_matches_jit():
    (jit,) = load("flax_dropin", "toy_jit")
    (jc,) = load("flax_dropin", "toy_jaxcomm")
    a, b = jit.main(steps=40), jc.main(steps=40)
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-4, atol=1e-6)
    leaves = [jax.tree.leaves(nnx.state(r["model"])) for r in (a, b)]
    for x, y in zip(*leaves, strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_cnn_batch_norm_and_metrics_match_jit():
    (jit,) = load("flax_dropin", "cnn_jit")
    (jc,) = load("flax_dropin", "cnn_jaxcomm")
    # Without dropout the two programs compute the same thing: each device's
    # BatchNorm must normalise over the global batch, and the metrics count it.
    a, b = jit.main(steps=12, dropout=0.0), jc.main(steps=12, dropout=0.0)
    for ha, hb in zip(a["history"], b["history"], strict=True):
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(float(hb[key]), float(ha[key]), rtol=1e-4)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(float(b["train"][key]), float(a["train"][key]), rtol=1e-4)
    # Evaluation reads the running statistics, whose means differ slightly (below).
    np.testing.assert_allclose(float(b["test"]["loss"]), float(a["test"]["loss"]), rtol=1e-2)
    assert abs(float(b["test"]["accuracy"]) - float(a["test"]["accuracy"])) <= 1 / 256 + 1e-6
    for layer in ("batch_norm1", "batch_norm2"):
        bn_a, bn_b = getattr(a["model"], layer), getattr(b["model"], layer)
        np.testing.assert_allclose(bn_b.var[...], bn_a.var[...], rtol=1e-3, atol=1e-5)
        # The running mean also carries the conv bias, whose true gradient is
        # 0 under BatchNorm: Adam turns the rounding noise of that gradient
        # into steps of up to its learning rate, differently in each program.
        np.testing.assert_allclose(bn_b.mean[...], bn_a.mean[...], atol=2e-2)
        assert np.abs(np.asarray(bn_a.var[...]) - 1).max() > 1e-2  # the stats moved


def test_linen_train_state_matches_jit():
    (jit,) = load("flax_dropin", "linen_jit")
    (jc,) = load("flax_dropin", "linen_jaxcomm")
    a, b = jit.main(steps=25), jc.main(steps=25)
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-4)
    for x, y in zip(
        jax.tree.leaves(a["state"].params), jax.tree.leaves(b["state"].params), strict=True
    ):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6)
    assert int(b["state"].step) == 25


def test_dropout_masks_differ_per_device_and_step():
    n = jax.device_count()
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(3))

    @jaxcomm.data_parallel
    def masks(dropout, x):
        kept = dropout(x) != 0  # this device's rows
        every = lax.all_gather(kept, "data")  # the same on every device
        same_as_first = jnp.mean(jnp.all(every == every[0], axis=(1, 2)))
        code = jnp.sum(every[0] * jnp.arange(every[0].size).reshape(every[0].shape))
        return same_as_first, jnp.mean(kept), code

    x = jnp.ones((4 * n, 256))
    same, kept, first = masks(dropout, x)
    assert float(same) == 1 / n  # only the first device's mask equals its own
    # kept ~ Binomial(1024 n, 0.5) / (1024 n): 6 standard deviations.
    assert abs(float(kept) - 0.5) < 6 * 0.5 / np.sqrt(1024 * n)
    _, _, second = masks(dropout, x)
    assert float(second) != float(first)  # the stream advances between steps
    assert int(dropout.rngs.count[...]) == 2  # as two nnx.jit calls leave it


def test_value_and_grad_keeps_batch_norm_statistics_inside_shard_map():
    # The user's own nnx.shard_map step: BatchNorm's running mean must move
    # (nnx.value_and_grad carries it out), and the gradient must be local.
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    model = nnx.BatchNorm(3, axis_name="data", rngs=nnx.Rngs(0))
    x = np.arange(jax.device_count() * 2 * 3, dtype=np.float32).reshape(-1, 3)

    @nnx.shard_map(
        mesh=mesh,
        in_specs=(nnx.StateSharding({...: jax.P()}), jax.P("data")),
        out_specs=jax.P("data"),
    )
    def grads(model, x):
        _, g = jaxcomm.value_and_grad(lambda m: jnp.sum(m(x) * x), "data")(model)
        return g["bias"][...][None]

    with jax.set_mesh(mesh):
        g = nnx.jit(grads)(model, jax.device_put(x, jax.P("data")))
    np.testing.assert_allclose(model.mean[...], 0.01 * x.mean(0), rtol=1e-6)  # momentum 0.99
    per_device = x.reshape(jax.device_count(), 2, 3).sum(1)  # d/dbias of sum(y * x)
    np.testing.assert_allclose(np.asarray(g), per_device, rtol=1e-6)


def test_error_feedback_state_rows_per_device():
    # Per-device state (a residual) is carried with one row per device.
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    with jax.set_mesh(mesh):
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        tx = optax.chain(
            jaxcomm.allreduce_gradients("data", wire_dtype="float16", error_feedback=True),
            optax.sgd(0.1),
        )
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @jaxcomm.data_parallel
        def step(model, optimizer, x):
            loss, grads = jaxcomm.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        x = np.random.default_rng(0).standard_normal((8 * jax.device_count(), 4))
        step(model, optimizer, x.astype(np.float32) / 3)
    residual = optimizer.opt_state[0].residual.value["kernel"][...]
    assert residual.shape == (jax.device_count(), 4, 1)
    assert len({np.asarray(r).tobytes() for r in residual}) > 1  # each device its own


def test_refuses_params_updated_without_jaxcomm():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @jaxcomm.data_parallel
    def step(model, optimizer, x):
        _, grads = jaxcomm.value_and_grad(lambda m: jnp.mean(m(x)))(model)
        optimizer.update(model, grads)

    with pytest.raises(ValueError, match=r"args\[0\]\.bias \(Param\) differs per device.*jaxcomm"):
        step(model, optimizer, jnp.ones((jax.device_count(), 2)))


def test_jax_value_and_grad_of_a_model_with_dropout_is_told_what_to_use():
    """jax.value_and_grad differentiates every leaf of the module, its RNG
    keys too: JAX's dtype error becomes one that names the fix, and the same
    process then runs the corrected step."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 1, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    model = Model(nnx.Rngs(0, dropout=1))
    tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jnp.ones((2 * jax.device_count(), 2))

    def step_with(value_and_grad):
        @jaxcomm.data_parallel
        def step(model, optimizer, x):
            loss, grads = value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        return step

    with pytest.raises(TypeError, match=r"integer leaves.*Use jaxcomm.value_and_grad"):
        step_with(jax.value_and_grad)(model, optimizer, x)
    assert np.isfinite(float(step_with(jaxcomm.value_and_grad)(model, optimizer, x)))


def test_refuses_per_device_outputs_that_are_not_scalars():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    @jaxcomm.data_parallel
    def step(model, x):
        return {"predictions": model(x)}

    with pytest.raises(ValueError, match=r"output\['predictions'\].*differs per device"):
        step(model, jnp.ones((jax.device_count(), 2)))


def test_refuses_a_batch_statistic_computed_per_device():
    class Stat(nnx.Variable):
        pass

    class Counter(nnx.Module):
        def __init__(self):
            self.seen = Stat(jnp.zeros(2))

        def __call__(self, x):
            self.seen[...] = self.seen[...] + x.sum(0)
            return x

    @jaxcomm.data_parallel
    def step(counter, x):
        counter(x)

    with pytest.raises(ValueError, match=r"args\[0\]\.seen.*Stat.*lax.pmean"):
        step(Counter(), jnp.ones((jax.device_count(), 2)))


def test_value_and_grad_needs_an_axis_outside_data_parallel():
    with pytest.raises(ValueError, match="axis_name is required outside jaxcomm.data_parallel"):
        jaxcomm.value_and_grad(lambda w: jnp.sum(w))(jnp.ones(2))


def test_accumulate_inside_data_parallel_against_numpy():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = np.random.default_rng(0).standard_normal((8 * jax.device_count(), 4)).astype(np.float32)
    with jax.set_mesh(mesh):
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        chain = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(0.1))
        optimizer = nnx.Optimizer(
            model, jaxcomm.accumulate(chain, "data", every_k=2), wrt=nnx.Param
        )

        @jaxcomm.data_parallel
        def step(model, optimizer, x):
            loss, grads = jaxcomm.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        k0, b0 = np.asarray(model.kernel[...], np.float64), np.asarray(model.bias[...], np.float64)
        step(model, optimizer, x)
        np.testing.assert_array_equal(model.kernel[...], k0)  # the first micro-step sends nothing
        step(model, optimizer, x)
    residual = x.astype(np.float64) @ k0 + b0  # both micro-steps saw the same batch
    want = k0 - 0.1 * 2 * x.T @ residual / len(x)
    np.testing.assert_allclose(model.kernel[...], want, rtol=1e-5)


def test_state_specs_of_an_nnx_object_go_to_nnx_shard_map_as_they_are():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = np.random.default_rng(0).standard_normal((8 * jax.device_count(), 4)).astype(np.float32)
    with jax.set_mesh(mesh):
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        wire = jaxcomm.allreduce_gradients("data", wire_dtype="float16", error_feedback=True)
        optimizer = nnx.Optimizer(model, optax.chain(wire, optax.sgd(0.1)), wrt=nnx.Param)
        specs = jaxcomm.state_specs(optimizer, "data")
        assert isinstance(specs, nnx.StateSharding)

        @nnx.jit
        @nnx.shard_map(
            mesh=mesh,
            in_specs=(nnx.StateSharding({...: jax.P()}), specs, jax.P("data")),
            out_specs=jax.P(),
        )
        def step(model, optimizer, x):
            loss, grads = jaxcomm.value_and_grad(lambda m: jnp.mean(m(x) ** 2), "data")(model)
            optimizer.update(model, grads)
            return lax.pmean(loss, "data")

        k0 = np.asarray(model.kernel[...], np.float64)
        b0 = np.asarray(model.bias[...], np.float64)
        step(model, optimizer, jax.device_put(x, jax.P("data")))
    want = k0 - 0.1 * 2 * x.T @ (x @ k0 + b0) / len(x)  # the float16 wire: 1e-3
    np.testing.assert_allclose(model.kernel[...], want, rtol=2e-3, atol=1e-4)
    assert optimizer.opt_state[0].residual.value["kernel"][...].shape == (jax.device_count(), 4, 1)


def test_replicated_keys_draw_differently_per_device_and_per_stacked_layer():
    n = jax.device_count()

    @jaxcomm.data_parallel
    def draws(key, x):
        mine = jax.random.uniform(key, x.shape[1:])
        every = lax.all_gather(mine, "data")
        return jnp.mean(jnp.all(every == every[0], axis=1))

    assert float(draws(jax.random.key(0), jnp.ones((n, 3)))) == 1 / n

    # One key per stacked layer (nnx.vmap, nn.scan): each layer's stream
    # differs per device and stays its own.
    @jaxcomm.data_parallel
    def stacked(keys, x):
        mine = jax.vmap(lambda k: jax.random.uniform(k, x.shape[1:]))(keys)  # (layers, 3)
        every = lax.all_gather(mine, "data")  # (devices, layers, 3)
        same_device = jnp.all(every == every[0], axis=2).mean()
        same_layer = jnp.all(mine == mine[0], axis=1).mean()
        return same_device, lax.pmax(same_layer, "data")

    mesh = jax.make_mesh((n,), ("data",))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 4), jax.NamedSharding(mesh, jax.P()))
    same_device, same_layer = stacked(keys, jnp.ones((n, 3)))
    assert float(same_device) == 1 / n and float(same_layer) == 1 / 4

    # The same for an NNX module's stacked RNG stream (nnx.split_rngs).
    class Layers(nnx.Module):
        def __init__(self):
            self.rngs = nnx.Rngs(dropout=jax.random.split(jax.random.key(1), 4))

    @jaxcomm.data_parallel
    def stacked_nnx(model, x):
        draw = nnx.vmap(lambda r: jax.random.uniform(r.dropout(), x.shape[1:]), in_axes=0)
        mine = draw(model.rngs)
        every = lax.all_gather(mine, "data")
        same_device = jnp.all(every == every[0], axis=2).mean()
        return same_device, lax.pmax(jnp.all(mine == mine[0], axis=1).mean(), "data")

    same_device, same_layer = stacked_nnx(Layers(), jnp.ones((n, 3)))
    assert float(same_device) == 1 / n and float(same_layer) == 1 / 4

    @jaxcomm.data_parallel
    def returns_a_key(key, x):
        return jax.random.split(key)[0]

    with pytest.raises(ValueError, match="PRNG key.*split the key outside the step"):
        returns_a_key(jax.random.key(0), jnp.ones((n, 3)))


def test_the_readme_jit_snippet_runs_and_learns(capsys):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## In a program written for `jit`") :]
    section = section[: section.index("\n## ", 1)]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    loss = float(capsys.readouterr().out.split()[-1])
    start = float(np.mean(scope["x"][:, :4] ** 2))  # the untrained model's error is about this
    assert loss < 0.3 * start, (loss, start)
    kernel = scope["model"].layers[0].kernel[...]
    assert kernel.sharding.is_fully_replicated  # the state comes back replicated
