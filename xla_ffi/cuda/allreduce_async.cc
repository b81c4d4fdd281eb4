// An allreduce that outlives the step that starts it, on GPU: the CUDA twin of
// cpu/allreduce_async.cc, with the same handle ([nonce, op_id, sequence]),
// the same nonce and missing_ok rules and the same messages. With a chunk
// mask the selected chunks travel packed and the done call writes zeros
// between them, as jaxcomm_allreduce's masked schedule with zeros does on GPU
// (the same pack, so the same bits): the mask stays on the device, so the
// packed buffer has all chunks' room, zero-padded.
//
// jaxcomm_allreduce_start copies x into a buffer jaxcomm owns (on XLA's
// stream, so XLA may reuse x at once), and runs the in-step handler's
// reduction (ReduceContiguous on jaxcomm's own communicators, the device
// group's started lane: cuda/communicators.h) on a stream jaxcomm owns, one
// per device, which first waits for XLA's stream to reach the call.
// jaxcomm_allreduce_done, in this or a later execution, makes XLA's stream
// wait for that exchange, copies the result out and frees the buffers behind
// the copy. In between, XLA's stream computes while the exchange runs.
//
// Only on jaxcomm's own communicators: XLA lends its communicators for one
// call, and runs its own collectives on them on its stream, so an exchange
// that outlives the call cannot use them.
//
// Device memory is the device's stream-ordered pool (cudaMallocAsync), not
// XLA's allocator: XLA's blocks are ordered on XLA's stream and live for one
// call. With XLA's default preallocation that pool has what XLA left (25%).
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "common/ffi_bindings.h"
#include "common/ffi_contract.h"
#include "cuda/check.h"
#include "cuda/collective.h"
#include "cuda/communicators.h"
#include "cuda/handlers.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"

namespace jaxcomm::cuda {
namespace {

const char kStart[] = "allreduce_start";
const char kDone[] = "allreduce_done";

// Device memory from the pool, ordered on `stream`; freed there, after the
// work already issued on it.
class StreamMemory final : public DeviceMemory {
 public:
  explicit StreamMemory(cudaStream_t stream) : stream_(stream) {}
  Status Allocate(size_t bytes, void** out) override {
    *out = nullptr;
    if (cudaError_t err = cudaMallocAsync(out, bytes, stream_); err != cudaSuccess) {
      return Status(Code::kInternal,
                    "jaxcomm " + std::string(kStart) + ": could not allocate " +
                        std::to_string(bytes) +
                        " bytes of device memory (cudaMallocAsync: " + cudaGetErrorName(err) +
                        "); XLA_PYTHON_CLIENT_MEM_FRACTION below 0.75 leaves it more");
    }
    return Status::Ok();
  }
  void Free(void* data) override {
    if (data != nullptr) cudaFreeAsync(data, stream_);  // a failure only leaks
  }

 private:
  cudaStream_t stream_;
};

// jaxcomm's stream on `device`, made on first use and kept for the process:
// started exchanges run on it in the order they are started, which is the
// same on every device of a call site.
Status OwnStream(int device, cudaStream_t* out) {
  static auto* mu = new std::mutex();
  static auto* streams = new std::map<int, cudaStream_t>();
  std::lock_guard<std::mutex> lock(*mu);
  if (auto it = streams->find(device); it != streams->end()) {
    *out = it->second;
    return Status::Ok();
  }
  // Non-blocking: the legacy default stream must not order it.
  JAXCOMM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(out, cudaStreamNonBlocking));
  (*streams)[device] = *out;
  return Status::Ok();
}

// A started allreduce: its buffers until the done call frees them, and the
// event its result is ready at.
struct Started {
  int32_t handle[3];  // the start's copy into its handle reads these
  void* out = nullptr;
  size_t bytes = 0;  // of the result
  cudaEvent_t reduced = nullptr;
  // With a chunk mask: `out` is packed; the mask and its chunk offsets, kept
  // on the device for the unpack.
  bool masked = false;
  size_t n = 0, isz = 0;
  int64_t chunk_size = 0, nchunks = 0;
  bool* mask = nullptr;
  int32_t* offsets = nullptr;

  // Frees the buffers on `stream`, behind what was issued there.
  void Free(cudaStream_t stream) {
    StreamMemory memory(stream);
    memory.Free(out);
    memory.Free(mask);
    memory.Free(offsets);
  }
};

// Started allreduces not yet taken by their done call, by (device, op_id,
// sequence).
class StartedTable {
 public:
  static StartedTable& Get() {
    static auto* table = new StartedTable();  // never destroyed: streams outlive exit
    return *table;
  }

  int64_t NextSequence(int32_t device, int64_t op_id) {
    std::lock_guard<std::mutex> lock(mu_);
    return next_[{device, op_id}]++;
  }

  void Add(int32_t device, int64_t op_id, int64_t sequence, std::unique_ptr<Started> op) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_[{device, op_id, sequence}] = std::move(op);
  }

  // Removes and returns the operation; null when there is none.
  std::unique_ptr<Started> Take(int32_t device, int64_t op_id, int64_t sequence) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find({device, op_id, sequence});
    if (it == ops_.end()) return nullptr;
    std::unique_ptr<Started> op = std::move(it->second);
    ops_.erase(it);
    return op;
  }

 private:
  std::mutex mu_;
  std::map<std::tuple<int32_t, int64_t, int64_t>, std::unique_ptr<Started>> ops_;
  std::map<std::pair<int32_t, int64_t>, int64_t> next_;
};

// Issues the exchange of n elements at `in` into `out` on `own`, after XLA's
// stream has produced `in`; records `reduced` after it. `joined`: whether
// `own` waits for XLA's stream, so that what follows on `own` comes after
// the copy into `in`.
Status IssueExchange(cudaStream_t xla, cudaStream_t own, int32_t device, const int32_t* coords,
                     const StartAttrs& attrs, const ReduceSpec& spec, const void* in, void* out,
                     size_t n, cudaEvent_t* reduced, bool* joined) {
  const ReductionAttrs& r = attrs.reduction;
  *joined = false;
  cudaEvent_t ready;
  JAXCOMM_RETURN_IF_ERROR(RecordEvent(xla, &ready));
  const cudaError_t waited = cudaStreamWaitEvent(own, ready, 0);
  cudaEventDestroy(ready);  // the wait keeps the recorded point
  JAXCOMM_RETURN_IF_ERROR(FromCuda(waited, "cudaStreamWaitEvent"));
  *joined = true;
  StreamMemory memory(own);
  {
    Scratch scratch(memory);  // freed on `own` behind the exchange
    JAXCOMM_RETURN_IF_ERROR(RunOnOwnComms(
        own, device, coords, attrs.op_id, r.nranks,
        [&](const CommSet& set, CudaKernels& k) {
          return ReduceContiguous(set, k, own, scratch, static_cast<Algorithm>(r.algorithm),
                                  r.intra_size, spec, in, out, n);
        },
        Lane::kStarted));
  }
  return RecordEvent(own, reduced);
}

// Packs the chunks `mask` selects into `in` (n elements, zero past them) on
// XLA's stream, and keeps the mask and its offsets in op for the done call.
Status PackOnXla(cudaStream_t xla, const void* x, const bool* mask, Started& op, void* in) {
  StreamMemory on_xla(xla);
  JAXCOMM_RETURN_IF_ERROR(
      on_xla.Allocate(op.nchunks * sizeof(bool), reinterpret_cast<void**>(&op.mask)));
  JAXCOMM_RETURN_IF_ERROR(
      on_xla.Allocate((op.nchunks + 1) * sizeof(int32_t), reinterpret_cast<void**>(&op.offsets)));
  JAXCOMM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(op.mask, mask, op.nchunks * sizeof(bool), cudaMemcpyDeviceToDevice, xla));
  JAXCOMM_RETURN_IF_ERROR(LaunchChunkOffsets(xla, op.mask, op.nchunks, op.offsets));
  JAXCOMM_RETURN_IF_ERROR(
      LaunchPackChunks(xla, x, op.n, op.isz, op.mask, op.offsets, op.chunk_size, op.nchunks, in));
  return LaunchZeroPackedTail(xla, op.mask, op.offsets, op.nchunks, op.chunk_size, op.n, op.n,
                              op.isz, in);
}

ffi::Error StartImpl(cudaStream_t xla, int32_t device, ffi::AnyBuffer x,
                     ffi::Buffer<ffi::S32> coords, ffi::Buffer<ffi::PRED> mask,
                     ffi::Result<ffi::Buffer<ffi::S32>> handle, StartAttrs attrs) {
  ReduceSpec spec;
  if (auto err = DecodeReduction(kStart, x, coords, attrs.reduction, &spec); !err.success()) {
    return err;
  }
  if (handle->element_count() != 3) return Invalid(kStart, "the handle must hold 3 int32");
  if (attrs.op_id < 0 || attrs.op_id > INT32_MAX) {
    return Invalid(kStart, "op_id must fit in int32");
  }
  auto op = std::make_unique<Started>();
  op->n = x.element_count();
  op->isz = SizeOf(spec.input);
  op->masked = mask.element_count() > 0;
  if (op->masked) {
    op->chunk_size = attrs.chunk_size;
    if (auto err =
            CheckChunkMask(kStart, op->n, attrs.chunk_size, mask.element_count(), &op->nchunks);
        !err.success()) {
      return err;
    }
  }
  ScopedDevice scoped(device);
  if (!scoped.status().ok()) return ToError(scoped.status());
  cudaStream_t own;
  if (Status st = OwnStream(device, &own); !st.ok()) return ToError(st);

  // The buffers come from XLA's stream's order: x is copied (or packed)
  // there, before XLA can reuse it, whatever jaxcomm's stream is still busy
  // with.
  const size_t bytes = x.size_bytes();
  void* in = nullptr;
  StreamMemory on_xla(xla);
  op->bytes = bytes;
  if (bytes > 0) {
    Status st = on_xla.Allocate(bytes, &in);
    if (st.ok()) st = on_xla.Allocate(bytes, &op->out);
    if (st.ok() && op->masked) {
      st = PackOnXla(xla, x.untyped_data(), mask.typed_data(), *op, in);
    } else if (st.ok()) {
      st = FromCuda(cudaMemcpyAsync(in, x.untyped_data(), bytes, cudaMemcpyDeviceToDevice, xla),
                    "cudaMemcpyAsync (x)");
    }
    if (!st.ok()) {
      on_xla.Free(in);
      op->Free(xla);
      return ToError(st);
    }
  }
  bool joined = false;
  Status st = IssueExchange(xla, own, device, coords.typed_data(), attrs, spec, in, op->out,
                            x.element_count(), &op->reduced, &joined);
  const int64_t sequence = StartedTable::Get().NextSequence(device, attrs.op_id);
  op->handle[0] = attrs.nonce;
  op->handle[1] = static_cast<int32_t>(attrs.op_id);
  op->handle[2] = static_cast<int32_t>(sequence);
  // The handle is device memory: written on XLA's stream from op's copy,
  // which the table keeps until the done call has read the handle back.
  if (st.ok()) {
    st = FromCuda(cudaMemcpyAsync(handle->typed_data(), op->handle, sizeof(op->handle),
                                  cudaMemcpyHostToDevice, xla),
                  "cudaMemcpyAsync (handle)");
  }
  // The input is the exchange's alone: freed behind it. Where jaxcomm's
  // stream never joined XLA's, nothing of the exchange was issued, and XLA's
  // stream frees both behind the copy into `in`.
  StreamMemory free_on(joined ? own : xla);
  free_on.Free(in);
  if (!st.ok()) {
    op->Free(joined ? own : xla);
    if (op->reduced != nullptr) cudaEventDestroy(op->reduced);
    return ToError(st);
  }
  StartedTable::Get().Add(device, attrs.op_id, sequence, std::move(op));
  return ffi::Error::Success();
}

ffi::Error DoneImpl(cudaStream_t xla, int32_t device, ffi::Buffer<ffi::S32> handle,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> found,
                    int32_t nonce, bool missing_ok) {
  static const int32_t kFound[2] = {0, 1};  // static: the copies read them later
  if (handle.element_count() != 3 || found->element_count() != 1) {
    return Invalid(kDone, "the handle must hold 3 int32, `found` one");
  }
  ScopedDevice scoped(device);
  if (!scoped.status().ok()) return ToError(scoped.status());
  // The handle names the operation on the host, so it is read back: this
  // waits for the work XLA queued before the call, not for the exchange.
  int32_t h[3];
  if (Status st =
          FromCuda(cudaMemcpyAsync(h, handle.typed_data(), sizeof(h), cudaMemcpyDeviceToHost, xla),
                   "cudaMemcpyAsync (handle)");
      !st.ok()) {
    return ToError(st);
  }
  if (Status st = FromCuda(cudaStreamSynchronize(xla), "cudaStreamSynchronize"); !st.ok()) {
    return ToError(st);
  }
  std::unique_ptr<Started> op =
      h[0] == nonce ? StartedTable::Get().Take(device, h[1], h[2]) : nullptr;
  if (Status st = FromCuda(cudaMemcpyAsync(found->typed_data(), &kFound[op != nullptr],
                                           sizeof(int32_t), cudaMemcpyHostToDevice, xla),
                           "cudaMemcpyAsync (found)");
      !st.ok()) {
    return ToError(st);
  }
  if (!op && missing_ok) return ffi::Error::Success();  // the caller reduces what it kept
  if (!op) {
    return MissingHandle(device, h, nonce);
  }
  Status st;
  if (op->bytes != y->size_bytes()) {
    st = Status(Code::kInvalidArgument, std::string("jaxcomm ") + kDone +
                                            ": the result must have the started input's size");
  } else {
    st = FromCuda(cudaStreamWaitEvent(xla, op->reduced, 0), "cudaStreamWaitEvent");
    if (st.ok() && op->bytes > 0 && op->masked) {
      CudaKernels k(xla);
      k.Zero(y->untyped_data(), op->bytes);
      st = k.status();
      if (st.ok()) {
        st = LaunchUnpackChunks(xla, op->out, op->n, op->isz, op->mask, op->offsets, op->chunk_size,
                                op->nchunks, y->untyped_data());
      }
    } else if (st.ok() && op->bytes > 0) {
      st = FromCuda(
          cudaMemcpyAsync(y->untyped_data(), op->out, op->bytes, cudaMemcpyDeviceToDevice, xla),
          "cudaMemcpyAsync (result)");
    }
  }
  // Freed behind the copy on XLA's stream, which waited for the exchange;
  // where that wait failed, on jaxcomm's stream behind the exchange.
  cudaStream_t own = nullptr;
  if (st.ok()) {
    op->Free(xla);
  } else if (OwnStream(device, &own).ok()) {
    op->Free(own);
  }
  cudaEventDestroy(op->reduced);  // waits already issued keep its point
  return ToError(st);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceStartCuda, StartImpl,
                              BindAllReduceStart(ffi::Ffi::Bind()
                                                     .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                     .Ctx<ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceDoneCuda, DoneImpl,
                              BindAllReduceDone(ffi::Ffi::Bind()
                                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<ffi::DeviceOrdinal>()));

}  // namespace jaxcomm::cuda
