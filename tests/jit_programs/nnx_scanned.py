"""A small NNX language model as Flax's guides write a scanned stack: blocks
made by ``nnx.split_rngs`` + ``nnx.vmap`` (a "layers" axis in their
partitioning metadata), run with ``nnx.scan``, Dropout, logical axis names
mapped onto an Auto ("data", "fsdp") mesh by ``nnx.logical_axis_rules``, and
a constraint on the activations."""

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from tests.jit_programs import counting_tokens, leaf_placements, scanned_lm_mesh

RULES = (("batch", "data"), ("embed", "fsdp"), ("mlp", None), ("vocab", None), ("layers", None))
LAYERS, VOCAB, WIDTH = 3, 64, 32


mesh = scanned_lm_mesh


class Block(nnx.Module):
    def __init__(self, rngs, dropout):
        init = nnx.initializers.lecun_normal()
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        up = nnx.with_partitioning(init, ("embed", "mlp"))
        down = nnx.with_partitioning(init, ("mlp", "embed"))
        self.up = nnx.Linear(WIDTH, 2 * WIDTH, kernel_init=up, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * WIDTH, WIDTH, kernel_init=down, use_bias=False, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        h = self.drop(jax.nn.gelu(self.up(self.norm(x))))
        h = jax.lax.with_sharding_constraint(h, P("data", None, None))
        return x + self.down(h)


class LM(nnx.Module):
    def __init__(self, rngs, dropout=0.0):
        table = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=table, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs):
            return Block(rngs, dropout)

        self.blocks = blocks(rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def layer(x, block):
            return block(x)

        return self.embed.attend(layer(self.embed(tokens), self.blocks))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def build(tx, on, dropout=0.0):
    with jax.set_mesh(on), nnx.logical_axis_rules(RULES):
        model = LM(nnx.Rngs(0), dropout)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def jit_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


@jaxcomm.data_parallel
def jaxcomm_step(model, optimizer, tokens):
    loss, grads = jaxcomm.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


def batches(on, n, seed=0):
    rng = np.random.default_rng(seed)
    put = NamedSharding(on, P("data"))
    return [(jax.device_put(counting_tokens(rng, VOCAB), put),) for _ in range(n)]


def run(form, objects, data, on):
    """The losses of `form` ("jit" or "jaxcomm") over `data`, one step in flight."""
    step = jit_step if form == "jit" else jaxcomm_step
    with jax.set_mesh(on), nnx.logical_axis_rules(RULES):
        return [float(jax.block_until_ready(step(*objects, *batch))) for batch in data]


def placements(objects, params_only=False):
    """(shape, spec) of every param, then of every optimizer leaf."""
    model, optimizer = objects
    tree = nnx.state(model) if params_only else (nnx.state(model), nnx.state(optimizer))
    return leaf_placements(tree)
