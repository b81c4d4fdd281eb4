"""Every private JAX name jaxcomm reaches, and every test of JAX's version.

Each function meets one need that jax 0.10.2 has no public API for, and
names the private JAX it reaches; nothing else in the package imports ``jax._src``,
``jax.interpreters`` or ``jaxlib`` (``tests/test_layers.py`` checks), so a
JAX release that moves a name breaks here, in one place. Every import is made
when a function is called, so this module imports no JAX of its own, and none
of its functions starts a backend.

Examples:
  >>> from jaxcomm import _jax_compat
  >>> _jax_compat.jaxlib_version() >= (0, 10)
  True
  >>> _jax_compat.concrete_mesh() is None  # outside jax.set_mesh
  True
  >>> _jax_compat.distributed_state().client is None  # before jax.distributed.initialize
  True
"""

from __future__ import annotations

import re


def bound_axis_sizes() -> dict:
    """``{name: size}`` of the mesh / ``pmap`` axes bound at this point of the
    trace (``jax._src.core.get_axis_env``): no public API lists them.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomm import _jax_compat
      >>> _jax_compat.bound_axis_sizes()
      {}
      >>> jax.pmap(lambda x: x + len(_jax_compat.bound_axis_sizes()), "i")(jnp.zeros(1))
      Array([1.], dtype=float32)
    """
    from jax._src import core

    return dict(core.get_axis_env().axis_sizes)


def concrete_mesh():
    """The ``jax.sharding.Mesh`` set with ``jax.set_mesh``, or ``None`` where
    none is (``jax._src.mesh.get_concrete_mesh``): the public
    ``jax.sharding.get_mesh`` refuses to run under ``jit``, and
    ``get_abstract_mesh`` has no devices."""
    from jax._src.mesh import get_concrete_mesh

    mesh = get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh


def distributed_state():
    """The state ``jax.distributed.initialize`` set up
    (``jax._src.distributed.global_state``): its ``client`` (the key-value
    store), ``service`` (process 0's coordination service, else ``None``),
    ``coordinator_address``, ``num_processes`` and ``process_id``, all
    ``None`` before ``initialize``. The public ``jax.distributed`` gives only
    ``is_initialized``."""
    from jax._src.distributed import global_state

    return global_state


def register_gloo_cpu_backend(hostname: str | None, interface: str | None) -> None:
    """Makes JAX's CPU backend, once it starts, create its gloo collectives on
    ``hostname`` / ``interface`` (``jax._src.xla_bridge.register_backend_factory``
    with ``jaxlib._jax.make_gloo_tcp_collectives``): ``make_cpu_client`` creates
    gloo with neither, and no public option passes them."""
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed_state().client,
            hostname=hostname,
            interface=interface,
        )
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def jaxlib_version() -> tuple[int, ...]:
    """jaxlib's version as numbers, ``(0, 10, 2)`` for ``"0.10.2"`` and for
    ``"0.10.2.dev20250101"`` (``jaxlib.__version__``): for behaviour that
    differs between releases and that no feature test can see."""
    import jaxlib

    numbers = []
    for part in jaxlib.__version__.split(".")[:3]:
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.end() < len(part):  # "0rc1": a pre-release suffix ends the number
            break
    return tuple(numbers)


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends (and with them XLA's threads)
    (``jax._src.xla_bridge.backends_are_initialized``): no public API says."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()
