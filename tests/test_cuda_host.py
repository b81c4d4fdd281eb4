"""Host-side logic of the CUDA backend that runs without a GPU: scratch memory
(xla_ffi/cuda/scratch.h) against an XLA FFI API that applies XLA's own rules
for XLA_FFI_DeviceMemory_Allocate (alignment a power of two, at most 16); the
device groups whose cliques the handlers ask XLA for (xla_ffi/cuda/groups.h);
the collectives on 8 host ranks over a host "device" and a loopback NCCL
(xla_ffi/host_device/, tests/cuda_host/), both on jaxcomm's own communicators
and on XLA's, lent through a fake of XLA's FFI collectives extension (where
jax's FFI headers have that extension: jaxlib 0.11 on); and the extension
modules (the CPU one, and the CUDA one where it is built) export nothing but
their PyInit_* (no statically linked cudart, no XLA FFI templates for another
module to bind to).

The C++ below and in tests/cuda_host/ is compiled with the host compiler
against jax's FFI headers, with XLA's side of each call faked in
tests/cuda_host/fake_xla_ffi.h; it needs no CUDA, so it runs in CI. A failed
check prints what it saw.
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRATCH_TEST = r"""
#include <iostream>
#include <string>

#include "check.h"
#include "cuda/scratch.h"
#include "fake_xla_ffi.h"

using fake_xla::memory;

int main() {
  fake_xla::HostContext hc;
  const xla::ffi::Context ctx(&fake_xla::api, fake_xla::AsCtx(hc));
  {
    jaxcomm::cuda::Scratch scratch(ctx);
    void* a = nullptr;
    void* b = nullptr;
    void* none = &hc;
    jaxcomm::Status st = scratch.Allocate(100, &a);
    if (!st.ok()) std::cout << "allocate(100): " << st.message() << "\n";
    CHECK(st.ok() && a != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(a) % jaxcomm::cuda::kScratchAlignment == 0);
    CHECK(scratch.Allocate(4096, &b).ok() && b != nullptr && b != a);
    CHECK(scratch.Allocate(0, &none).ok() && none == nullptr);
    CHECK(memory.live.size() == 2);

    memory.refuse_above = 1000;
    void* big = &hc;
    st = scratch.Allocate(5000, &big);
    std::cout << "refused: " << st.message() << "\n";
    CHECK(!st.ok() && big == nullptr);
    CHECK(st.message().find("could not allocate 5000 bytes of scratch") != std::string::npos);
    CHECK(st.message().find("Out of memory while trying to allocate 5000 bytes") !=
          std::string::npos);
    CHECK(fake_xla::errors_made == 1 && fake_xla::errors_destroyed == 1);
  }
  CHECK(memory.live.empty() && memory.frees == 2 && memory.bad_frees == 0);
  return Result();
}
"""


GROUPS_TEST = r"""
#include <iostream>
#include <vector>

#include "check.h"
#include "cuda/groups.h"

using jaxcomm::cuda::Groups;


// The schedule gives rank r of a group intra rank r % L and inter rank r / L:
// each device must sit at exactly those positions of its sub-groups.
void CheckPositions(const Groups& groups, int L) {
  const Groups intra = jaxcomm::cuda::IntraGroups(groups, L);
  const Groups inter = jaxcomm::cuda::InterGroups(groups, L);
  for (const auto& g : groups) {
    for (size_t r = 0; r < g.size(); ++r) {
      int found_intra = 0, found_inter = 0;
      for (const auto& s : intra) {
        for (size_t i = 0; i < s.size(); ++i) found_intra += s[i] == g[r] && i == r % L;
      }
      for (const auto& s : inter) {
        for (size_t i = 0; i < s.size(); ++i) found_inter += s[i] == g[r] && i == r / L;
      }
      CHECK(found_intra == 1);
      CHECK(found_inter == 1);
    }
  }
}

int main() {
  const int64_t flat[] = {0, 1, 2, 3, 4, 5, 6, 7};
  Groups groups;
  CHECK(jaxcomm::cuda::GroupsFromFlat(flat, 8, 4, &groups).ok());
  CHECK((groups == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  CHECK(!jaxcomm::cuda::GroupsFromFlat(flat, 6, 4, &groups).ok());
  CHECK(!jaxcomm::cuda::GroupsFromFlat(flat, 8, 0, &groups).ok());
  CHECK(!jaxcomm::cuda::GroupsFromFlat(flat, 0, 1, &groups).ok());

  const Groups two{{0, 1, 2, 3}, {4, 5, 6, 7}};
  CHECK((jaxcomm::cuda::IntraGroups(two, 2) == Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  CHECK((jaxcomm::cuda::InterGroups(two, 2) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  // Ranks in another order than device ids (a reduction over (local, node)).
  const Groups shuffled{{0, 4, 1, 5, 2, 6, 3, 7}};
  CHECK((jaxcomm::cuda::IntraGroups(shuffled, 4) == Groups{{0, 4, 1, 5}, {2, 6, 3, 7}}));
  CHECK((jaxcomm::cuda::InterGroups(shuffled, 4) == Groups{{0, 2}, {4, 6}, {1, 3}, {5, 7}}));
  for (int L : {1, 2, 4, 8}) CheckPositions(shuffled, L);
  for (int L : {1, 2, 4}) CheckPositions(two, L);
  return Result();
}
"""


def _host_binary(tmp_path_factory, name, source, extra_sources=(), flags=()):
    """Compiles one C++ test program (with `extra_sources` from the repo)
    against xla_ffi/ and jax's FFI headers."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    work = tmp_path_factory.mktemp("cuda_host")
    src = work / f"{name}.cc"
    src.write_text(source)
    exe = work / name
    includes = [ROOT / "xla_ffi", ROOT / "tests" / "cuda_host", jax.ffi.include_dir()]
    cmd = [cxx, "-std=c++17", "-O1", *(f"-I{d}" for d in includes), *flags]
    sources = [str(src), *(str(ROOT / s) for s in extra_sources)]
    build = subprocess.run(
        [*cmd, *sources, "-o", str(exe)], capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return exe


def _run_ok(exe):
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == "ok"


@pytest.fixture(autouse=True)
def _enough_devices():
    """Overrides conftest's 8-device rule: nothing here runs on a JAX device,
    so the test also runs on a GPU machine (against that jaxlib's headers)."""


@pytest.mark.slow
def test_scratch_follows_xla_allocator_rules_and_reports_its_reason(tmp_path_factory):
    _run_ok(_host_binary(tmp_path_factory, "scratch_test", SCRATCH_TEST))


@pytest.mark.slow
def test_hierarchical_sub_groups_put_each_rank_where_the_schedule_expects(tmp_path_factory):
    _run_ok(_host_binary(tmp_path_factory, "groups_test", GROUPS_TEST))


# The CUDA backend's host code as it is (the collective handlers, communicator
# cache and rendezvous, watchdog, RunOnOwnComms, ReduceContiguous,
# NcclTransport, the schedules), compiled against the host device and loopback
# NCCL of xla_ffi/host_device/, on jaxcomm's own communicators.
OWN_COMMS_SOURCES = (
    "xla_ffi/host_device/host_device.cc",
    "xla_ffi/host_device/kernels.cc",
    "xla_ffi/cuda/allreduce.cc",
    "xla_ffi/cuda/reduce_scatter.cc",
    "xla_ffi/cuda/all_gather.cc",
    "xla_ffi/cuda/communicators.cc",
    "xla_ffi/cuda/collective.cc",
    "xla_ffi/cuda/alltoall.cc",
    "xla_ffi/cuda/nccl_transport.cc",
    "xla_ffi/algorithm/schedule.cc",
    "xla_ffi/cpu/cpu_kernels.cc",
)


@pytest.mark.slow
def test_cuda_collectives_on_host_ranks_through_the_real_nccl_transport(tmp_path_factory):
    """8 ranks on host threads: ring, hierarchical (L=2, 4: the ncclCommSplit
    path) and direct (ncclAllReduce) for every wire type and sizes 1000, 3
    and 0 match an exact sum; a second call site over the same devices reuses
    the communicators and other devices get their own; calls that stay in
    progress are awaited, and past the timeout aborted; an absent rank is
    named; a failed NCCL call reports NCCL's message; a hung receive is
    aborted by the watchdog and every later call on those communicators fails
    with the reason; a unique id registered for a call site (several
    processes) gives that site its own communicators. The handlers, called
    through XLA call frames: allreduce sums only the chunks a mask selects,
    reduce_scatter then all_gather give the padded sum, and bad arguments are
    reported with the messages the CPU handlers use."""
    _run_collective_program(tmp_path_factory, "own_comms_test", OWN_COMMS_SOURCES, xla_comms=0)


def _run_collective_program(tmp_path_factory, name, sources, *, xla_comms: int):
    """Builds tests/cuda_host/<name>.cc with the CUDA handlers on the host
    device and runs it."""
    source = (ROOT / "tests" / "cuda_host" / f"{name}.cc").read_text()
    exe = _host_binary(
        tmp_path_factory,
        name,
        source,
        extra_sources=sources,
        flags=("-DJAXCOMM_HOST_DEVICE=1", f"-DJAXCOMM_XLA_COMMS={xla_comms}", "-pthread"),
    )
    _run_ok(exe)


# The same handlers on XLA's own communicators (xla_ffi/cuda/xla_comms.cc),
# lent by a fake of XLA's collectives extension (tests/cuda_host/).
XLA_COMMS_SOURCES = (*OWN_COMMS_SOURCES, "xla_ffi/cuda/xla_comms.cc")


def _ffi_has_collectives_extension() -> bool:
    api = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api"
    return (api / "collectives_api.h").is_file()


@pytest.mark.slow
def test_cuda_collectives_on_xla_communicators_through_the_collectives_extension(
    tmp_path_factory,
):
    """8 ranks on host threads, each call as XLA makes it: a Prepare frame,
    the cliques it requested acquired (one loopback NCCL communicator per
    device and clique, ranked by position in the group, kept across calls),
    an Execute frame. allreduce (ring, hierarchical with 1, 2, 4 and 8 ranks
    per node, direct; float32 and bfloat16 wires; groups in id order,
    interleaved, reversed, and two groups), the masked allreduce with
    max_chunks, and reduce_scatter then all_gather match exact sums, and
    Prepare asked for exactly the groups each needs (hierarchical: the nodes
    and the ranks of equal local index) by flattened ids on XLA's own
    communication id. The rank check reads the device once per communicator;
    a call that stays in progress is awaited. What fails is reported: a clique
    whose ranks are not the devices' positions, a node size that does not
    divide the group, groups that leave devices out (XLA refuses the
    request), an Execute without a Prepare, a failed NCCL call (after which
    the aborted cliques are made again and sum right). Every scratch block and
    every error goes back to XLA."""
    if not _ffi_has_collectives_extension():
        pytest.skip(
            f"jax {jax.__version__}'s FFI headers have no collectives extension "
            "(xla/ffi/api/collectives_api.h, jaxlib 0.11 on): the handlers use "
            "jaxcomm's own communicators there"
        )
    _run_collective_program(tmp_path_factory, "xla_comms_test", XLA_COMMS_SOURCES, xla_comms=1)


def test_cuda_module_registers_the_collectives_and_keeps_the_kernels_for_tests():
    """jaxcomm registers registrations(): the collectives only (with the
    started allreduce where the handlers use jaxcomm's own communicators). The kernel
    handlers, which no jaxcomm call issues, come from testing_registrations()
    for the tests and bench/kernels.py. Importing the module starts no CUDA."""
    if importlib.util.find_spec("jaxcomm._ffi_cuda") is None:
        pytest.skip("jaxcomm._ffi_cuda is not built")
    from jaxcomm import _ffi_cuda

    collectives = {"jaxcomm_allreduce", "jaxcomm_reduce_scatter", "jaxcomm_all_gather"}
    # The started allreduce runs on jaxcomm's own communicators only: XLA
    # lends its own for one call (xla_ffi/cuda/allreduce_async.cc).
    if not _ffi_cuda.uses_xla_communicators:
        collectives |= {"jaxcomm_allreduce_start", "jaxcomm_allreduce_done"}
    assert set(_ffi_cuda.registrations()) == collectives
    assert set(_ffi_cuda.testing_registrations()) == {
        "jaxcomm_cast",
        "jaxcomm_pack_chunks",
        "jaxcomm_unpack_chunks",
        "jaxcomm_chunk_norms",
    }


@pytest.mark.parametrize("module", ["_ffi", "_ffi_testing", "_ffi_cuda"])
def test_extension_module_exports_only_its_init(module):
    spec = importlib.util.find_spec(f"jaxcomm.{module}")
    if spec is None:
        pytest.skip(f"jaxcomm.{module} is not built")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm on PATH")
    listing = subprocess.run(
        [nm, "-D", "--defined-only", spec.origin],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    exported = [line.split()[-1] for line in listing.stdout.splitlines() if line.strip()]
    assert exported == [f"PyInit_{module}"], exported[:20]
