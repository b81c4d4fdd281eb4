// jaxcomm._ffi_testing: a thread harness that drives the CPU collective code
// without XLA, for what an XLA program cannot stage (a rank that never shows
// up, thousands of calls for a leak check), and two FFI handlers that stand
// for a transfer that waits (on the thread XLA gives it, or on one of its
// own behind a future), to see what XLA's CPU runtime runs while a custom
// call waits. Test-only: the production module
// (python_module.cc) does not carry it. It links its own copy of the CPU
// transport, so its rendezvous slots and timeout are its own: set_timeout and
// live_slots here act on the harness's copy, not on jaxcomm._ffi's.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "algorithm/schedule.h"
#include "cpu/allreduce.h"
#include "cpu/collective.h"
#include "cpu/direct.h"
#include "cpu/rendezvous.h"
#include "cpu/tcp_bindings.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;
namespace ffi = xla::ffi;

namespace jaxcomm::cpu {
namespace {

// Runs one allreduce with one thread per present rank; ranks in `absent`
// never show up. Returns each present rank's output, or raises with the
// first error a rank reported.
py::list RunThreads(const std::vector<py::array>& inputs, int32_t dtype, int32_t algorithm,
                    int32_t wire, double prescale, double postscale, int32_t intra_size,
                    const std::vector<int>& absent) {
  static std::atomic<int64_t> next_run{-1};  // negative: never an XLA RunId
  const int nranks = static_cast<int>(inputs.size());
  if (nranks == 0) throw py::value_error("need at least one input");
  if (!IsValidDType(dtype)) throw py::value_error("unknown dtype code");
  ReduceSpec spec;
  spec.input = static_cast<DType>(dtype);
  spec.wire = wire < 0 ? spec.input : static_cast<DType>(wire);
  spec.prescale = prescale;
  spec.postscale = postscale;
  const size_t n = inputs[0].size();
  for (const auto& a : inputs) {
    if (static_cast<size_t>(a.size()) != n ||
        static_cast<size_t>(a.itemsize()) != SizeOf(spec.input)) {
      throw py::value_error("inputs must share size and match the dtype code");
    }
  }
  std::vector<py::array> outputs;
  for (int r = 0; r < nranks; ++r)
    outputs.emplace_back(inputs[r].dtype(), std::vector<py::ssize_t>{static_cast<py::ssize_t>(n)});
  std::vector<const void*> in_ptrs;
  std::vector<void*> out_ptrs;
  for (int r = 0; r < nranks; ++r) {
    in_ptrs.push_back(inputs[r].data());
    out_ptrs.push_back(outputs[r].mutable_data());
  }
  const int64_t run = next_run.fetch_sub(1);
  std::vector<Status> status(nranks);
  {
    py::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (int r = 0; r < nranks; ++r) {
      if (std::find(absent.begin(), absent.end(), r) != absent.end()) continue;
      threads.emplace_back([&, r] {
        const CallSite site{
            "allreduce", run, 0, r, 0, r, nranks, intra_size, static_cast<Algorithm>(algorithm), 0};
        if (site.algorithm == Algorithm::kDirect) {
          std::promise<Status> done;
          std::future<Status> result = done.get_future();
          ArriveDirect({{run, 0, 0, Ring::kFlat, 0}, nranks, {site.op, 0}, spec, {n}},
                       {r, r, {in_ptrs[r]}, {out_ptrs[r]}, [&done](const Status& st) {
                          done.set_value(st);
                        }});
          status[r] = result.get();
          return;
        }
        status[r] = RunCollective(site, [&](Rings& rings) {
          return ReduceContiguous(rings, site.algorithm, spec, in_ptrs[r], out_ptrs[r], n);
        });
      });
    }
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < nranks; ++r) {
    if (!status[r].ok()) throw std::runtime_error(status[r].message());
  }
  py::list result;
  for (int r = 0; r < nranks; ++r) {
    if (std::find(absent.begin(), absent.end(), r) == absent.end()) result.append(outputs[r]);
  }
  return result;
}

// [start, end) of every wait, in seconds of the steady clock, by tag.
std::mutex waits_mu;
std::vector<std::tuple<int64_t, double, double>> waits;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// y = x after `seconds`: the wait is recorded under `tag`.
void Wait(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& y, double seconds, int64_t tag) {
  const double start = Now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  std::lock_guard<std::mutex> lock(waits_mu);
  waits.emplace_back(tag, start, Now());
}

ffi::Error WaitHere(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, double seconds, int64_t tag) {
  Wait(x, y, seconds, tag);
  return ffi::Error::Success();
}

// The wait on a thread of its own; XLA gets a future at once.
ffi::Future WaitBehindFuture(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, double seconds,
                             int64_t tag) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::thread([x, y, seconds, tag, promise = std::move(promise)]() mutable {
    Wait(x, y, seconds, tag);
    promise.SetAvailable();
  }).detach();
  return future;
}

XLA_FFI_DEFINE_HANDLER(kWaitHere, WaitHere,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<double>("seconds")
                           .Attr<int64_t>("tag"));
XLA_FFI_DEFINE_HANDLER(kWaitBehindFuture, WaitBehindFuture,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<double>("seconds")
                           .Attr<int64_t>("tag"));

py::list TakeWaits() {
  std::lock_guard<std::mutex> lock(waits_mu);
  py::list out;
  for (const auto& [tag, start, end] : waits) out.append(py::make_tuple(tag, start, end));
  waits.clear();
  return out;
}

}  // namespace
}  // namespace jaxcomm::cpu

PYBIND11_MODULE(_ffi_testing, m) {
  using namespace jaxcomm::cpu;
  m.doc() = "Test-only thread harness over jaxcomm's CPU collective code (no XLA).";
  m.def("run_threads", &RunThreads, py::arg("inputs"), py::arg("dtype"), py::arg("algorithm"),
        py::arg("wire") = -1, py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
        py::arg("intra_size") = 1, py::arg("absent") = std::vector<int>{});
  m.def("set_timeout", &SetTimeoutSeconds, py::arg("seconds"));
  DefineTcpFunctions(m);
  m.def("get_timeout", &TimeoutSeconds);
  m.def(
      "live_slots", [] { return Registry::Get().live_slots() + LiveDirectSlots(); },
      "The harness's rendezvous slots currently alive (0 when no collective is running).");
  m.def(
      "wait_handlers",
      [] {
        py::dict d;
        d["jaxcomm_testing_wait"] = py::capsule(reinterpret_cast<void*>(kWaitHere));
        d["jaxcomm_testing_wait_async"] = py::capsule(reinterpret_cast<void*>(kWaitBehindFuture));
        return d;
      },
      "FFI handlers (platform 'cpu'): y = x after `seconds`, on XLA's thread or behind a "
      "future.");
  m.def("take_waits", &TakeWaits, "[(tag, start_s, end_s)] of the waits so far, then clears.");
}
