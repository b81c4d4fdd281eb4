"""Training programs written as Flax's and JAX's sharding guides and MaxText
write them, each in its ``jit`` form and converted for jaxcomm by the
README's three changes (a jaxcomm transform at the head of the chain,
``jaxcomm.data_parallel`` for ``jit``, ``jaxcomm.value_and_grad`` for
``nnx.value_and_grad`` / ``jax.value_and_grad``), the model untouched.

Each module gives ``build(tx, mesh, dropout)`` (the training objects, placed
as the guide places them), ``jit_step`` and ``jaxcomm_step`` side by side,
``run(form, objects, batches, mesh)`` (the losses of form "jit" or
"jaxcomm", one step in flight), and
``placements(objects, params_only)`` (every param's, then optimizer leaf's,
placement). The helpers below are the tests', not the programs'.
"""

import jax
import numpy as np


def leaf_placements(tree) -> list:
    """(shape, spec) of every array of `tree`, in order: what a test
    compares before and after steps."""
    return [
        (a.shape, a.sharding.spec._normalized_spec_for_aval(a.ndim)) for a in jax.tree.leaves(tree)
    ]


def scanned_lm_mesh(fsdp: int = 4):
    """The language models' Auto ("data", "fsdp") mesh."""
    return jax.make_mesh((2, fsdp), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def counting_tokens(rng, vocab: int, rows: int = 16, length: int = 9):
    """Token rows that count up from a random start (mod `vocab`): learnable
    in a few steps, where uniform random tokens are not."""
    start = rng.integers(0, vocab, (rows, 1))
    return ((start + np.arange(length)) % vocab).astype(np.int32)
