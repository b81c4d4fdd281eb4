"""A MaxText-shaped Linen language model: ``nn.scan`` over its blocks with a
"layers" partition name, ``nn.with_logical_partitioning`` on every kernel,
``nn.with_logical_constraint`` on the activations, logical rules over an Auto
("data", "fsdp") mesh, a ``TrainState`` built under ``jit`` with
``out_shardings`` from the logical specs, and a ``jit`` step with in and out
shardings."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.jit_programs import counting_tokens, leaf_placements, scanned_lm_mesh

RULES = (("batch", "data"), ("embed", "fsdp"), ("mlp", None), ("vocab", None), ("layers", None))
LAYERS, VOCAB, WIDTH = 3, 64, 32


mesh = scanned_lm_mesh


class Block(nn.Module):
    dropout: float

    @nn.compact
    def __call__(self, x, _):
        up = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        down = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        h = nn.Dense(2 * WIDTH, kernel_init=up, use_bias=False)(nn.LayerNorm()(x))
        h = nn.with_logical_constraint(h, ("batch", None, "mlp"))
        h = nn.Dropout(self.dropout, deterministic=False)(nn.gelu(h))
        x = x + nn.Dense(WIDTH, kernel_init=down, use_bias=False)(h)
        return nn.with_logical_constraint(x, ("batch", None, "embed")), None


class LM(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, tokens):
        table = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed"))
        embed = nn.Embed(VOCAB, WIDTH, embedding_init=table)
        x = nn.with_logical_constraint(embed(tokens), ("batch", None, "embed"))
        stack = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=LAYERS,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = stack(self.dropout)(x, None)
        return embed.attend(x)


def loss_fn(params, apply_fn, tokens, key):
    logits = apply_fn({"params": params}, tokens[:, :-1], rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def build(tx, on, dropout=0.0):
    model = LM(dropout)

    def init(key):
        params = model.init(key, jnp.zeros((2, 8), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    with jax.set_mesh(on), nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(init, jax.random.key(0))
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), on, RULES)
        state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
    return [state, shardings]


def train_step(state, tokens, key):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, tokens, key)
    return state.apply_gradients(grads=grads), loss


def jaxcomm_train_step(state, tokens, key):
    loss, grads = jaxcomm.value_and_grad(loss_fn)(state.params, state.apply_fn, tokens, key)
    return state.apply_gradients(grads=grads), loss


def jit_step(on, shardings):
    batch = NamedSharding(on, P("data"))
    return jax.jit(
        train_step, in_shardings=(shardings, batch, None), out_shardings=(shardings, None)
    )


jaxcomm_step = jaxcomm.data_parallel(jaxcomm_train_step)


def batches(on, n, seed=0):
    rng = np.random.default_rng(seed)
    put = NamedSharding(on, P("data"))
    return [(jax.device_put(counting_tokens(rng, VOCAB), put), jax.random.key(i)) for i in range(n)]


def run(form, objects, data, on):
    """The losses of `form` ("jit" or "jaxcomm") over `data`, one step in
    flight; objects = [state, its shardings], the state updated."""
    fn = jit_step(on, objects[1]) if form == "jit" else jaxcomm_step
    losses = []
    with jax.set_mesh(on), nn.logical_axis_rules(RULES):
        for tokens, key in data:
            objects[0], loss = fn(objects[0], tokens, key)
            losses.append(float(jax.block_until_ready(loss)))
    return losses


def placements(objects, params_only=False):
    """(shape, spec) of every param, then of every optimizer leaf."""
    state = objects[0]
    return leaf_placements(state.params if params_only else (state.params, state.opt_state))
