"""The CUDA started allreduce (xla_ffi/cuda/allreduce_async.cc:
jaxcomm_allreduce_start and jaxcomm_allreduce_done) on 8 host ranks, over
the host "device" and loopback NCCL of xla_ffi/host_device/, called through
XLA call frames as in tests/test_cuda_host.py (tests/cuda_host/started_test.cc).
Needs no GPU, so it runs in CI; a failed check prints what it saw.
"""

from __future__ import annotations

import pytest

from tests.test_cuda_host import OWN_COMMS_SOURCES, _run_collective_program

STARTED_SOURCES = (*OWN_COMMS_SOURCES, "xla_ffi/cuda/allreduce_async.cc")


@pytest.fixture(autouse=True)
def _enough_devices():
    """Overrides conftest's 8-device rule: nothing here runs on a JAX device."""


@pytest.mark.slow
def test_started_allreduce_on_host_ranks(tmp_path_factory):
    """float32 and bfloat16 (ring, 1000 elements; 3, fewer than ranks; and
    none): start, then done, gives the in-step handler's bits on the same
    inputs, and is close to a float64 sum; the start waits for XLA's stream
    to produce x (written there late) and copies it before XLA reuses it
    (overwritten right after the start). With a chunk mask (float32 and
    bfloat16; one that selects nothing) the done call gives the in-step
    masked handler's bits with zeros between the chunks, and the selected
    chunks' float64 sum. A handle nobody started is an error, or with
    missing_ok found = 0 and the result untouched; another job's nonce, in
    the attribute or in the handle, is refused and leaves the operation for
    the right done call; a handle is finished once. Two exchanges in flight
    from one call site get sequences 0 and 1 and each done returns its own
    input's sum; the second start makes no host wait, XLA's stream runs on
    while the (slowed) exchanges are under way, and a done waits for XLA's
    stream once. An in-step allreduce on the same devices while a slowed
    started one is in flight finishes beside it, not after it (the started
    one has communicators of its own), and both sums are right. start refuses
    a bad algorithm, a non-float input, an op_id past int32 and a mask of the
    wrong length; done refuses a result of the wrong size. Every error goes
    back to XLA."""
    _run_collective_program(tmp_path_factory, "started_test", STARTED_SOURCES, xla_comms=0)
