"""The thread -> element plans of the CUDA map and chunk-copy kernels
(xla_ffi/cuda/vector_plan.h) without a GPU: tests/cuda_host/vector_plan_test.cc
walks every (block, thread) of the grids the launches compute, for lengths
from 0 to a few tiles, every start misalignment of input and output and
every element-size pair, and checks that each element is handled exactly
once, in range, by aligned vector accesses, and that pack and unpack copy
each selected chunk's elements to their places and nothing else.
"""

from __future__ import annotations

import pathlib

import pytest
from test_cuda_host import _host_binary, _run_ok


@pytest.fixture(autouse=True)
def _enough_devices():
    """Nothing here runs on a JAX device (see test_cuda_host.py)."""


def test_every_element_is_handled_once_by_aligned_accesses(tmp_path_factory):
    source = (pathlib.Path(__file__).parent / "cuda_host" / "vector_plan_test.cc").read_text()
    _run_ok(_host_binary(tmp_path_factory, "vector_plan_test", source))
