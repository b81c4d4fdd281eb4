// Device memory from XLA's allocator for one handler call. Instead of
// ffi::ScratchAllocator, which on failure leaves XLA's reason in a
// diagnostic that nobody reads once the handler runs, this calls the C API
// itself, so the error says why (out of memory, bad alignment, ...).
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

// The most XLA_FFI_DeviceMemory_Allocate accepts: it rejects any larger
// alignment ("Unsupported alignment"). Enough for every buffer here: the
// kernels read and write single elements, NCCL takes any address, and the
// schedules carve sub-buffers at multiples of 64 bytes from the block start.
inline constexpr size_t kScratchAlignment = 16;

// Device memory jaxcomm owns, for work that outlives the handler call (a
// started allreduce on jaxcomm's stream): XLA's scratch is ordered on XLA's
// stream, so a block it frees as the handler returns may be reused before
// work on another stream is done with it. Free is ordered after the work
// already issued on the owner's stream.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual Status Allocate(size_t bytes, void** out) = 0;
  virtual void Free(void* data) = 0;
};

// Blocks live until the handler returns; stream order keeps them valid for
// the work the handler enqueued, as with XLA's own scratch allocator.
class Scratch {
 public:
  explicit Scratch(const xla::ffi::Context& ctx) : api_(ctx.api()), ctx_(ctx.ctx()) {}
  // Blocks from `memory` instead of XLA's allocator, given back to it on
  // destruction.
  explicit Scratch(DeviceMemory& memory) : memory_(&memory) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  ~Scratch() {
    for (const auto& [data, size] : blocks_) {
      if (memory_ != nullptr) {
        memory_->Free(data);
        continue;
      }
      XLA_FFI_DeviceMemory_Free_Args args;
      args.struct_size = XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE;
      args.extension_start = nullptr;
      args.ctx = ctx_;
      args.size = size;
      args.data = data;
      // Nothing to report to at this point; a failed free only leaks.
      if (XLA_FFI_Error* err = api_->XLA_FFI_DeviceMemory_Free(&args)) DestroyError(err);
    }
  }

  // `bytes` of device memory aligned to kScratchAlignment; 0 bytes gives nullptr.
  Status Allocate(size_t bytes, void** out) {
    *out = nullptr;
    if (bytes == 0) return Status::Ok();
    if (memory_ != nullptr) {
      JAXCOMM_RETURN_IF_ERROR(memory_->Allocate(bytes, out));
      blocks_.emplace_back(*out, bytes);
      return Status::Ok();
    }
    XLA_FFI_DeviceMemory_Allocate_Args args;
    args.struct_size = XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.ctx = ctx_;
    args.size = bytes;
    args.alignment = kScratchAlignment;
    args.data = nullptr;
    if (XLA_FFI_Error* err = api_->XLA_FFI_DeviceMemory_Allocate(&args)) {
      return Status(Code::kInternal, "jaxcomm: could not allocate " + std::to_string(bytes) +
                                         " bytes of scratch: " + TakeMessage(err));
    }
    if (args.data == nullptr) {
      return Status(Code::kInternal, "jaxcomm: XLA returned no memory for " +
                                         std::to_string(bytes) + " bytes of scratch");
    }
    blocks_.emplace_back(args.data, bytes);
    *out = args.data;
    return Status::Ok();
  }

 private:
  // ffi.h's own helpers for these two: the C structs behind them differ
  // between jaxlib versions (XLA_FFI_Error_GetMessage became GetDetails).
  std::string TakeMessage(XLA_FFI_Error* err) const {
    const char* message = xla::ffi::internal::GetErrorMessage(api_, err);
    std::string msg = message != nullptr ? message : "(XLA gave no reason)";
    DestroyError(err);
    return msg;
  }

  void DestroyError(XLA_FFI_Error* err) const { xla::ffi::internal::DestroyError(api_, err); }

  const XLA_FFI_Api* api_ = nullptr;
  XLA_FFI_ExecutionContext* ctx_ = nullptr;
  DeviceMemory* memory_ = nullptr;  // set: not XLA's memory
  std::vector<std::pair<void*, size_t>> blocks_;
};

}  // namespace jaxcomm::cuda
