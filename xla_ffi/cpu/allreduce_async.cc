// An allreduce that outlives the step that starts it.
//
// jaxcomm_allreduce_start copies its input, starts the reduction on a jaxcomm
// worker thread (or leaves it at the direct rendezvous) and returns at once
// with a handle; jaxcomm_allreduce_done, given that handle in a later
// execution, waits for the result and copies it out. In between, the
// exchange runs while XLA computes other steps: DiLoCo's delayed outer sync
// sends its pseudo-gradient this way (docs/diloco.md, "Delay and mixing").
// A handle this job never started (a restored state's) is an error, or, with
// `missing_ok`, reported as not found: the caller then reduces the input it
// kept itself. With a chunk mask only the selected chunks are copied and
// travel, as in jaxcomm_allreduce's masked schedule (the same packed
// reduction, so the same bits), and the done call writes zeros between
// them: chunk_sparse's exchange, started at the end of a step.
//
// The handle is [nonce, op_id, sequence]. Every device starts a call site's
// allreduces in the same order, so the handle is the same on every device of
// a call (the result can be typed replicated); the operation waits under
// (device, op_id, sequence) in this process. The nonce is drawn once per job
// (Python passes it to both calls): a new job's call-site ids and sequence
// numbers restart, so a handle restored from another job's state could
// otherwise name one of this job's operations.
#include "cpu/allreduce_async.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "common/ffi_contract.h"
#include "cpu/allreduce.h"
#include "cpu/async.h"
#include "cpu/collective.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

namespace ffi = xla::ffi;

double Now() {
  // steady_clock is CLOCK_MONOTONIC on Linux: Python's time.monotonic().
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct InFlight {
  std::mutex mu;
  std::condition_variable cv;
  bool reduced = false;
  Status status;
  // Owned: XLA may reuse x's buffer as soon as the start call returns.
  // Packed where a mask selects chunks of the input (n elements of isz bytes).
  std::vector<char> in, out;
  std::vector<Range> chunks;
  bool masked = false;
  size_t n = 0, isz = 0;
  AsyncEvent event;

  void Finish(const Status& st) {
    std::lock_guard<std::mutex> lock(mu);
    status = st;
    reduced = true;
    event.reduced = Now();
    cv.notify_all();
  }
};

// Operations started and not yet taken by their done call, and the log of
// finished ones.
class InFlightTable {
 public:
  static InFlightTable& Get() {
    static auto* table = new InFlightTable();  // never destroyed: workers outlive exit
    return *table;
  }

  // Registers `op` under the next sequence number of (device, op_id).
  int64_t Add(int32_t device, int64_t op_id, std::shared_ptr<InFlight> op) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t sequence = next_[{device, op_id}]++;
    ops_[{device, op_id, sequence}] = std::move(op);
    return sequence;
  }

  // Removes and returns the operation; null when there is none.
  std::shared_ptr<InFlight> Take(int32_t device, int64_t op_id, int64_t sequence) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find({device, op_id, sequence});
    if (it == ops_.end()) return nullptr;
    std::shared_ptr<InFlight> op = std::move(it->second);
    ops_.erase(it);
    return op;
  }

  void Log(const AsyncEvent& event) {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back(event);
    if (log_.size() > kLogSize) log_.pop_front();
  }

  std::vector<AsyncEvent> Timeline() {
    std::lock_guard<std::mutex> lock(mu_);
    return {log_.begin(), log_.end()};
  }

  size_t Size() {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_.size();
  }

 private:
  static constexpr size_t kLogSize = 4096;
  std::mutex mu_;
  std::map<std::tuple<int32_t, int64_t, int64_t>, std::shared_ptr<InFlight>> ops_;
  std::map<std::pair<int32_t, int64_t>, int64_t> next_;
  std::deque<AsyncEvent> log_;
};

const char kStart[] = "allreduce_start";
const char kDone[] = "allreduce_done";

ffi::Error StartImpl(Caller caller, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> coords,
                     ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::Buffer<ffi::S32>> handle,
                     StartAttrs attrs) {
  const ReductionAttrs& r = attrs.reduction;
  const int64_t op_id = attrs.op_id;
  const int32_t device = caller.device;
  ReduceSpec spec;
  if (auto err = DecodeReduction(kStart, x, coords, r, &spec); !err.success()) return err;
  if (handle->element_count() != 3) return Invalid(kStart, "the handle must hold 3 int32");
  if (op_id < 0 || op_id > INT32_MAX) return Invalid(kStart, "op_id must fit in int32");
  auto op = std::make_shared<InFlight>();
  op->n = x.element_count();
  op->isz = SizeOf(spec.input);
  op->masked = mask.element_count() > 0;
  const char* data = static_cast<const char*>(x.untyped_data());
  size_t n = op->n;  // what travels
  if (op->masked) {
    int64_t nchunks = 0;
    if (auto err = CheckChunkMask(kStart, op->n, attrs.chunk_size, mask.element_count(), &nchunks);
        !err.success()) {
      return err;
    }
    op->chunks = SelectedChunks(mask.typed_data(), nchunks, attrs.chunk_size, op->n, nchunks);
    n = 0;
    for (const Range& c : op->chunks) n += c.size();
  }
  CallSite site;
  if (Status st = SiteOf(kStart, caller, coords.typed_data(), PlacementOf(op_id, r),
                         Fingerprint(OpTag::kAllReduceStart,
                                     {static_cast<int64_t>(n), static_cast<int>(spec.input),
                                      static_cast<int>(spec.wire), r.algorithm, r.intra_size,
                                      op->masked ? attrs.chunk_size : -1,
                                      static_cast<int64_t>(op->chunks.size())}),
                         &site);
      !st.ok()) {
    return ToError(st);
  }

  if (op->masked) {
    // One byte at least: a mask that selects nothing still names buffers.
    op->in.resize(std::max<size_t>(n * op->isz, 1));
    Pack(op->chunks, data, op->in.data(), op->isz);
  } else {
    op->in.assign(data, data + x.size_bytes());
  }
  op->out.resize(op->in.size());
  op->event = {device, op_id, 0, static_cast<int64_t>(n * op->isz), Now(), 0, 0, 0};
  op->event.sequence = InFlightTable::Get().Add(device, op_id, op);
  handle->typed_data()[0] = attrs.nonce;
  handle->typed_data()[1] = static_cast<int32_t>(op_id);
  handle->typed_data()[2] = static_cast<int32_t>(op->event.sequence);

  const Algorithm algo = ScheduleOf(site);
  if (algo == Algorithm::kDirect) {
    ArriveDirectThen(site, spec, {n}, {op->in.data()}, {op->out.data()},
                     [op](const Status& st) { op->Finish(st); });
  } else {
    RunOnWorker([site, algo, spec, op, n] {
      op->Finish(RunCollective(site, [&](Rings& rings) {
        return ReduceContiguous(rings, algo, spec, op->in.data(), op->out.data(), n);
      }));
    });
  }
  return ffi::Error::Success();
}

ffi::Future DoneImpl(int32_t device, ffi::Buffer<ffi::S32> handle, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Buffer<ffi::S32>> found, int32_t nonce, bool missing_ok) {
  if (handle.element_count() != 3 || found->element_count() != 1) {
    return CompletedFuture(Invalid(kDone, "the handle must hold 3 int32, `found` one"));
  }
  const int32_t* h = handle.typed_data();
  std::shared_ptr<InFlight> op =
      h[0] == nonce ? InFlightTable::Get().Take(device, h[1], h[2]) : nullptr;
  found->typed_data()[0] = op != nullptr;
  if (!op && missing_ok) {  // the caller reduces what it kept instead; y is not read
    return CompletedFuture(ffi::Error::Success());
  }
  if (!op) {
    return CompletedFuture(MissingHandle(device, h, nonce));
  }
  if (op->n * op->isz != y->size_bytes()) {
    return CompletedFuture(Invalid(kDone, "the result must have the started input's size"));
  }
  op->event.landed = Now();
  char* out = static_cast<char*>(y->untyped_data());
  ffi::Promise promise;
  ffi::Future future(promise);
  // Waits off XLA's threads: a device still on its way to the start of a
  // later collective must not find the pool blocked (cpu/async.h).
  RunOnWorker([op, out, promise = std::move(promise)]() mutable {
    std::unique_lock<std::mutex> lock(op->mu);
    op->cv.wait(lock, [&] { return op->reduced; });
    if (!op->status.ok()) return promise.SetError(ToError(op->status));
    if (op->masked) {
      Unpack(op->chunks, nullptr, op->out.data(), out, op->n, op->isz, /*zero=*/true);
    } else {
      std::memcpy(out, op->out.data(), op->out.size());
    }
    op->event.returned = Now();
    InFlightTable::Get().Log(op->event);
    promise.SetAvailable();
  });
  return future;
}

}  // namespace

std::vector<AsyncEvent> AsyncTimeline() { return InFlightTable::Get().Timeline(); }

size_t AllReducesInFlight() { return InFlightTable::Get().Size(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceStartCpu, StartImpl,
                              BindAllReduceStart(ffi::Ffi::Bind().Ctx<Caller>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceDoneCpu, DoneImpl,
                              BindAllReduceDone(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>()));

}  // namespace jaxcomm::cpu
