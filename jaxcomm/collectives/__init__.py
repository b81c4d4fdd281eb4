"""One front end per collective; backends in _xla.py (JAX) and _ffi.py (xla_ffi/)."""

from jaxcomm.collectives.all_gather import all_gather
from jaxcomm.collectives.allreduce import allreduce
from jaxcomm.collectives.reduce_scatter import reduce_scatter

__all__ = ["all_gather", "allreduce", "reduce_scatter"]
