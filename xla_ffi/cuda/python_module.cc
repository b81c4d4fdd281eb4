// jaxcomm._ffi_cuda: the CUDA handler capsules, the integer codes their
// attributes take, and what Python must hand NCCL before the first call when
// several processes share a communicator. A separate module so a CPU-only
// install never loads CUDA or NCCL.
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "common/python_codes.h"
#include "cuda/communicators.h"
#include "cuda/handlers.h"
#include "cuda/runtime.h"
#include "cuda/xla_comms.h"

namespace py = pybind11;

namespace jaxcomm::cuda {
namespace {

template <typename Fn>
py::capsule Capsule(Fn* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

// A collective on XLA's communicators has two stages: Prepare requests the
// cliques, Execute runs on them.
template <typename Fn>
py::dict OnXlaComms(Fn* execute) {
  py::dict stages;
#if JAXCOMM_XLA_COMMS
  stages["prepare"] = Capsule(PrepareXlaComms);
#endif
  stages["execute"] = Capsule(execute);
  return stages;
}

py::dict Registrations() {
  py::dict d;
#if JAXCOMM_XLA_COMMS
  d["jaxcomm_allreduce"] = OnXlaComms(AllReduceCudaXlaComms);
  d["jaxcomm_reduce_scatter"] = OnXlaComms(ReduceScatterCudaXlaComms);
  d["jaxcomm_all_gather"] = OnXlaComms(AllGatherCudaXlaComms);
#else
  d["jaxcomm_allreduce"] = Capsule(AllReduceCuda);
  d["jaxcomm_reduce_scatter"] = Capsule(ReduceScatterCuda);
  d["jaxcomm_all_gather"] = Capsule(AllGatherCuda);
  // Only here: the exchange outlives the call, and XLA lends its
  // communicators for one call (cuda/allreduce_async.cc).
  d["jaxcomm_allreduce_start"] = Capsule(AllReduceStartCuda);
  d["jaxcomm_allreduce_done"] = Capsule(AllReduceDoneCuda);
#endif
  return d;
}

// The kernels alone, for the tests and bench/kernels.py to check and time:
// no jaxcomm call issues them, so jaxcomm does not register them.
py::dict TestingRegistrations() {
  py::dict d;
  d["jaxcomm_chunk_norms"] = Capsule(ChunkNormsCuda);
  d["jaxcomm_cast"] = Capsule(CastCuda);
  d["jaxcomm_pack_chunks"] = Capsule(PackChunksCuda);
  d["jaxcomm_unpack_chunks"] = Capsule(UnpackChunksCuda);
  return d;
}

py::bytes UniqueId() {
  ncclUniqueId id;
  Status st = NewUniqueId(&id);
  if (!st.ok()) throw std::runtime_error(st.message());
  return py::bytes(id.internal, sizeof(id.internal));
}

void Register(int64_t op_id, int64_t group, const py::bytes& raw) {
  const std::string bytes = raw;
  ncclUniqueId id;
  if (bytes.size() != sizeof(id.internal)) {
    throw py::value_error("an NCCL unique id has " + std::to_string(sizeof(id.internal)) +
                          " bytes, got " + std::to_string(bytes.size()));
  }
  std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  RegisterUniqueId(op_id, group, id);
}

int NcclVersion() {
  int version = 0;
  ncclGetVersion(&version);
  return version;
}

}  // namespace
}  // namespace jaxcomm::cuda

PYBIND11_MODULE(_ffi_cuda, m) {
  using namespace jaxcomm::cuda;
  m.doc() = "jaxcomm's CUDA XLA FFI handlers (NCCL) and their communicator set-up.";
  m.def("registrations", &Registrations,
        "Handler name -> PyCapsule (or {stage: PyCapsule}), for platform 'CUDA'.");
  m.def("testing_registrations", &TestingRegistrations,
        "The kernel handlers (cast, pack/unpack chunks, chunk norms): name -> PyCapsule, for "
        "platform 'CUDA'; for tests and benchmarks, not registered by jaxcomm.");
  jaxcomm::DefineCodes(m);
  m.attr("uses_xla_communicators") = py::bool_(JAXCOMM_XLA_COMMS);
  m.def("nccl_unique_id", &UniqueId, "A fresh ncclUniqueId, as bytes.");
  m.def("register_unique_id", &Register, py::arg("op_id"), py::arg("group"), py::arg("id"),
        "Sets the unique id the ranks of `group` use at call site `op_id` (several processes).");
  m.def("set_timeout", &SetTimeoutSeconds, py::arg("seconds"));
  m.def("get_timeout", &TimeoutSeconds);
  m.def("nccl_version", &NcclVersion, "NCCL_VERSION_CODE of the loaded libnccl.");
}
