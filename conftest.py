"""pytest setup for the tests and the docstring examples: 8 CPU devices unless
the caller already chose XLA_FLAGS (set before anything imports jax)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
