// jaxcomm._ffi: the handler capsules XLA needs, the integer codes their
// attributes take, and the counters Python reads.
// The tests' thread harness is a separate module (testing_module.cc).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/python_codes.h"
#include "cpu/allreduce_async.h"
#include "cpu/direct.h"
#include "cpu/handlers.h"
#include "cpu/rendezvous.h"
#include "cpu/stats.h"
#include "cpu/tcp_bindings.h"

namespace py = pybind11;

namespace jaxcomm::cpu {
namespace {

template <typename Fn>
py::capsule Capsule(Fn* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

py::dict Registrations() {
  py::dict d;
  d["jaxcomm_allreduce"] = Capsule(AllReduceCpu);
  d["jaxcomm_reduce_scatter"] = Capsule(ReduceScatterCpu);
  d["jaxcomm_all_gather"] = Capsule(AllGatherCpu);
  d["jaxcomm_after"] = Capsule(AfterCpu);
  d["jaxcomm_pool"] = Capsule(PoolCpu);
  d["jaxcomm_chunk_l1"] = Capsule(ChunkL1Cpu);
  d["jaxcomm_chunk_residual"] = Capsule(ChunkResidualCpu);
  d["jaxcomm_allreduce_parts"] = Capsule(AllReducePartsCpu);
  d["jaxcomm_allreduce_start"] = Capsule(AllReduceStartCpu);
  d["jaxcomm_allreduce_done"] = Capsule(AllReduceDoneCpu);
  return d;
}

}  // namespace
}  // namespace jaxcomm::cpu

PYBIND11_MODULE(_ffi, m) {
  using namespace jaxcomm::cpu;
  m.doc() = "jaxcomm's XLA FFI handlers and their counters.";
  m.def("registrations", &Registrations, "Handler name -> PyCapsule, for platform 'cpu'.");
  jaxcomm::DefineCodes(m);
  m.def(
      "stats",
      [] {
        py::list out;
        for (const DeviceStats& s : SnapshotStats()) {
          out.append(py::make_tuple(s.device, s.bytes_sent, s.calls));
        }
        return out;
      },
      "[(device_ordinal, bytes_sent, calls)] for devices that ran a CPU collective.");
  m.def("reset_stats", &ResetStats);
  m.def("set_timeout", &SetTimeoutSeconds, py::arg("seconds"));
  DefineTcpFunctions(m);
  m.def("get_timeout", &TimeoutSeconds);
  m.def(
      "live_slots",
      [] { return jaxcomm::cpu::Registry::Get().live_slots() + jaxcomm::cpu::LiveDirectSlots(); },
      "Rendezvous slots currently alive (0 when no collective is running).");
  m.def("in_flight", &AllReducesInFlight,
        "Allreduces started (jaxcomm_allreduce_start) and not yet finished by their done call.");
  m.def(
      "async_timeline",
      [] {
        py::list out;
        for (const AsyncEvent& e : AsyncTimeline()) {
          out.append(py::make_tuple(e.device, e.op_id, e.sequence, e.bytes, e.started, e.reduced,
                                    e.landed, e.returned));
        }
        return out;
      },
      "[(device, op_id, sequence, bytes, started, reduced, landed, returned)] of the last "
      "finished started allreduces; times in seconds of time.monotonic()'s clock.");
}
