// A fake of the XLA FFI API for the host-side test programs: what the
// handlers and Scratch ask of XLA (errors, device memory, the stream, the
// device ordinal), and call frames built the way XLA builds them.
//
// Device memory follows XLA's rules (xla/ffi/ffi_api.cc): the alignment must
// be a power of two and at most 16, and the allocator may refuse a size
// (`memory.refuse_above`). Blocks are tracked by address, so a test can see
// a leak or a bad free. Where the handlers run on the host device
// (JAXCOMM_HOST_DEVICE), a call has a stream, and XLA's allocator is
// stream-ordered: a block the handler frees as it returns may be reused only
// by work queued after the handler's, so it is released when the stream gets
// there. Elsewhere (no streams) it is released at once.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

#if JAXCOMM_HOST_DEVICE
#include "host_device/cuda_runtime.h"
#endif

struct XLA_FFI_Error {
  std::string message;
  XLA_FFI_Error_Code errc;
};

namespace fake_xla {

inline constexpr uint32_t kContextTag = 0x7e57c7;

// A handler call's execution context: its stream and device, and the
// extensions XLA attached to the call (an XLA_FFI_Extension list, where the
// API has them). The tag catches a context passed on wrongly.
struct HostContext {
#if JAXCOMM_HOST_DEVICE
  cudaStream_t stream = nullptr;
#endif
  int device = 0;
  const void* extensions = nullptr;
  uint32_t tag = kContextTag;
};

inline HostContext* FromCtx(XLA_FFI_ExecutionContext* ctx) {
  auto* hc = reinterpret_cast<HostContext*>(ctx);
  return hc != nullptr && hc->tag == kContextTag ? hc : nullptr;
}

// Every error the fake hands out, and every one given back: they must match.
inline std::atomic<int> errors_made{0}, errors_destroyed{0};

inline XLA_FFI_Error* MakeError(XLA_FFI_Error_Code errc, std::string message) {
  ++errors_made;
  return new XLA_FFI_Error{std::move(message), errc};
}

inline XLA_FFI_Error* CreateError(XLA_FFI_Error_Create_Args* args) {
  return MakeError(args->errc, args->message != nullptr ? args->message : "");
}

inline void DestroyError(XLA_FFI_Error_Destroy_Args* args) {
  ++errors_destroyed;
  delete args->error;
}

#if XLA_FFI_API_MINOR >= 4
inline void ErrorDetails(XLA_FFI_Error_GetDetails_Args* args) {
  args->message = args->error->message.c_str();
  args->errc = args->error->errc;
}
#else
inline void ErrorMessage(XLA_FFI_Error_GetMessage_Args* args) {
  args->message = args->error->message.c_str();
}
#endif

// XLA's device memory, as far as the tests look at it.
struct Memory {
  static constexpr size_t kMaxAlignment = 16;
  std::mutex mu;
  size_t refuse_above = ~size_t{0};
  std::map<void*, size_t> live;  // block -> the size it was allocated with
  int frees = 0, bad_frees = 0;
};
inline Memory memory;

inline XLA_FFI_Error* Allocate(XLA_FFI_DeviceMemory_Allocate_Args* args) {
  if (FromCtx(args->ctx) == nullptr) {
    return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT, "wrong context");
  }
  const size_t a = args->alignment;
  if (a == 0 || (a & (a - 1)) != 0 || a > Memory::kMaxAlignment) {
    return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "Unsupported alignment: " + std::to_string(a));
  }
  std::lock_guard<std::mutex> lock(memory.mu);
  if (args->size > memory.refuse_above) {
    return MakeError(XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                     "RESOURCE_EXHAUSTED: Out of memory while trying to allocate " +
                         std::to_string(args->size) + " bytes.");
  }
  const size_t bytes =
      (args->size + Memory::kMaxAlignment - 1) / Memory::kMaxAlignment * Memory::kMaxAlignment;
  args->data = std::aligned_alloc(Memory::kMaxAlignment, std::max<size_t>(bytes, 16));
  memory.live[args->data] = args->size;
  return nullptr;
}

inline XLA_FFI_Error* Free(XLA_FFI_DeviceMemory_Free_Args* args) {
  HostContext* hc = FromCtx(args->ctx);
  if (hc == nullptr) return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT, "wrong context");
  {
    std::lock_guard<std::mutex> lock(memory.mu);
    ++memory.frees;
    auto it = memory.live.find(args->data);
    if (it == memory.live.end() || it->second != args->size) {
      ++memory.bad_frees;
      return nullptr;
    }
    memory.live.erase(it);
  }
  void* data = args->data;
#if JAXCOMM_HOST_DEVICE
  jaxcomm::host_device::Enqueue(hc->stream, [data] { std::free(data); });
#else
  std::free(data);
#endif
  return nullptr;
}

#if JAXCOMM_HOST_DEVICE
inline XLA_FFI_Error* GetStream(XLA_FFI_Stream_Get_Args* args) {
  HostContext* hc = FromCtx(args->ctx);
  if (hc == nullptr) return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT, "wrong context");
  args->stream = hc->stream;
  return nullptr;
}
#endif

inline XLA_FFI_Error* GetDevice(XLA_FFI_DeviceOrdinal_Get_Args* args) {
  HostContext* hc = FromCtx(args->ctx);
  if (hc == nullptr) return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT, "wrong context");
  args->device_ordinal = hc->device;
  return nullptr;
}

inline XLA_FFI_Api MakeApi() {
  XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version.major_version = XLA_FFI_API_MAJOR;
  api.api_version.minor_version = XLA_FFI_API_MINOR;
  api.XLA_FFI_Error_Create = CreateError;
  api.XLA_FFI_Error_Destroy = DestroyError;
#if XLA_FFI_API_MINOR >= 4
  api.XLA_FFI_Error_GetDetails = ErrorDetails;
#else
  api.XLA_FFI_Error_GetMessage = ErrorMessage;
#endif
  api.XLA_FFI_DeviceMemory_Allocate = Allocate;
  api.XLA_FFI_DeviceMemory_Free = Free;
#if JAXCOMM_HOST_DEVICE
  api.XLA_FFI_Stream_Get = GetStream;
#endif
  api.XLA_FFI_DeviceOrdinal_Get = GetDevice;
  return api;
}
inline XLA_FFI_Api api = MakeApi();

inline XLA_FFI_ExecutionContext* AsCtx(HostContext& hc) {
  return reinterpret_cast<XLA_FFI_ExecutionContext*>(&hc);
}

// An attribute of a call frame: a scalar, or an array of `array_size`
// elements at `value`.
struct Attr {
  const char* name;
  XLA_FFI_DataType type;
  void* value;
  int64_t array_size = -1;  // -1: a scalar
};

inline XLA_FFI_Buffer Buf(XLA_FFI_DataType type, void* data, int64_t* dims) {
  return {XLA_FFI_Buffer_STRUCT_SIZE, nullptr, type, data, 1, dims};
}

// One handler call through a call frame as XLA builds it: buffers, then the
// attributes sorted by name (handlers look them up by binary search), in
// the given stage. Returns the handler's error message, "" if none.
inline std::string CallHandler(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*), HostContext& hc,
                               std::vector<XLA_FFI_Buffer> args, std::vector<XLA_FFI_Buffer> rets,
                               std::vector<Attr> attrs,
                               XLA_FFI_ExecutionStage stage = XLA_FFI_ExecutionStage_EXECUTE) {
  std::sort(attrs.begin(), attrs.end(),
            [](const Attr& a, const Attr& b) { return std::strcmp(a.name, b.name) < 0; });
  std::vector<XLA_FFI_ArgType> arg_types(args.size(), XLA_FFI_ArgType_BUFFER);
  std::vector<XLA_FFI_RetType> ret_types(rets.size(), XLA_FFI_RetType_BUFFER);
  std::vector<void*> arg_ptrs, ret_ptrs, attr_ptrs;
  for (auto& b : args) arg_ptrs.push_back(&b);
  for (auto& b : rets) ret_ptrs.push_back(&b);
  const size_t na = attrs.size();
  std::vector<XLA_FFI_Scalar> scalars(na);
  std::vector<XLA_FFI_Array> arrays(na);
  std::vector<XLA_FFI_ByteSpan> spans(na);
  std::vector<XLA_FFI_ByteSpan*> names(na);
  std::vector<XLA_FFI_AttrType> attr_types(na);
  for (size_t i = 0; i < na; ++i) {
    if (attrs[i].array_size < 0) {
      scalars[i] = {attrs[i].type, attrs[i].value};
      attr_types[i] = XLA_FFI_AttrType_SCALAR;
      attr_ptrs.push_back(&scalars[i]);
    } else {
      arrays[i] = {attrs[i].type, static_cast<size_t>(attrs[i].array_size), attrs[i].value};
      attr_types[i] = XLA_FFI_AttrType_ARRAY;
      attr_ptrs.push_back(&arrays[i]);
    }
    spans[i] = {attrs[i].name, std::strlen(attrs[i].name)};
    names[i] = &spans[i];
  }
  XLA_FFI_CallFrame frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = &api;
  frame.ctx = AsCtx(hc);
  frame.stage = stage;
  frame.args = {XLA_FFI_Args_STRUCT_SIZE, nullptr, static_cast<int64_t>(args.size()),
                arg_types.data(), arg_ptrs.data()};
  frame.rets = {XLA_FFI_Rets_STRUCT_SIZE, nullptr, static_cast<int64_t>(rets.size()),
                ret_types.data(), ret_ptrs.data()};
  frame.attrs = {XLA_FFI_Attrs_STRUCT_SIZE, nullptr,      static_cast<int64_t>(na),
                 attr_types.data(),         names.data(), attr_ptrs.data()};
  XLA_FFI_Error* err = handler(&frame);
  if (err == nullptr) return "";
  std::string message = err->message;
  XLA_FFI_Error_Destroy_Args destroy;
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.extension_start = nullptr;
  destroy.error = err;
  DestroyError(&destroy);
  return message.empty() ? "(error without a message)" : message;
}

}  // namespace fake_xla
