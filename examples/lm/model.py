"""A small decoder-only transformer over bytes, in Flax NNX.

Pre-LayerNorm blocks (causal multi-head self-attention, then a 4x GELU MLP),
learned positions, and the output layer tied to the byte embedding. The
defaults (2 layers, width 128, 4 heads, context 64) have 437,760 parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB = 256  # bytes


class CausalSelfAttention(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        if width % heads:
            raise ValueError(f"width={width} is not divisible by heads={heads}")
        self.heads = heads
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.out = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        batch, length, width = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        shape = (batch, length, self.heads, width // self.heads)
        y = jax.nn.dot_product_attention(
            q.reshape(shape), k.reshape(shape), v.reshape(shape), is_causal=True
        )
        return self.out(y.reshape(batch, length, width))


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.attn_norm = nnx.LayerNorm(width, rngs=rngs)
        self.attn = CausalSelfAttention(width, heads, rngs)
        self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
        self.mlp_in = nnx.Linear(width, 4 * width, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class ByteTransformer(nnx.Module):
    """Bytes [batch, length <= context] -> next-byte logits [batch, length, 256]."""

    def __init__(
        self, *, layers: int = 2, width: int = 128, heads: int = 4, context: int = 64, rngs
    ):
        self.context = context
        self.embed = nnx.Embed(VOCAB, width, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.position = nnx.Param(init(rngs.params(), (context, width)))
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens):
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"{length} tokens exceed the context of {self.context}")
        x = self.embed(tokens) + self.position[:length]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))


def count_params(model: nnx.Module) -> int:
    return sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
