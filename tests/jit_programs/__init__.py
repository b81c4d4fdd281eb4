"""Training programs written as Flax's and JAX's sharding guides and MaxText
write them, each in its ``jit`` form and converted for jaxcomm by the
README's three changes (a jaxcomm transform at the head of the chain,
``jaxcomm.data_parallel`` for ``jit``, ``jaxcomm.value_and_grad`` for
``nnx.value_and_grad`` / ``jax.value_and_grad``), the model untouched.

Each module gives ``build(tx, mesh, dropout)`` (the training objects, placed
as the guide places them), ``jit_step`` and ``jaxcomm_step`` side by side,
``run(step, objects, batches)`` (the losses, one step in flight), and
``placements(objects)`` (every param's and optimizer leaf's placement).
"""
