// pack_chunks / unpack_chunks: the selected chunks of a flat buffer moved to
// (and back from) the front of a dense one, with no host round trip: the
// destinations come from a device-side scan of the mask.

#include "common/ffi_contract.h"
#include "cuda/check.h"
#include "cuda/collective.h"
#include "cuda/handlers.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"

namespace jaxcomm::cuda {
namespace {

// The same checks, and messages, as the CPU handlers' chunk masks.
ffi::Error CheckChunks(const char* op, ffi::AnyBuffer x, ffi::Buffer<ffi::PRED> mask,
                       int64_t chunk_size, size_t* elem_bytes) {
  DType type;
  if (auto err = DecodeInput(op, x.element_type(), &type); !err.success()) return err;
  int64_t nchunks = 0;
  if (auto err = CheckChunkMask(op, x.element_count(), chunk_size, mask.element_count(), &nchunks);
      !err.success()) {
    return err;
  }
  *elem_bytes = SizeOf(type);
  return ffi::Error::Success();
}

Status Offsets(cudaStream_t stream, Scratch& scratch, const bool* mask, int64_t nchunks,
               int32_t** offsets) {
  void* block = nullptr;
  JAXCOMM_RETURN_IF_ERROR(scratch.Allocate((nchunks + 1) * sizeof(int32_t), &block));
  *offsets = static_cast<int32_t*>(block);
  return LaunchChunkOffsets(stream, mask, nchunks, *offsets);
}

// y[:packed] = the selected chunks of x in order; y[packed:] = 0. Only the
// selected bytes are read and only y is written, once.
ffi::Error PackImpl(cudaStream_t stream, ffi::Context ctx, ffi::AnyBuffer x,
                    ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::AnyBuffer> y,
                    int64_t chunk_size) {
  Scratch scratch(ctx);  // freed when the handler returns
  size_t isz = 0;
  if (auto err = CheckChunks("pack_chunks", x, mask, chunk_size, &isz); !err.success()) return err;
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count()) {
    return Invalid("pack_chunks", "output must be like x");
  }
  const size_t n = x.element_count();
  if (n == 0) return ffi::Error::Success();
  const int64_t nchunks = mask.element_count();
  int32_t* offsets = nullptr;
  Status st = Offsets(stream, scratch, mask.typed_data(), nchunks, &offsets);
  if (st.ok()) {
    st = LaunchPackChunks(stream, x.untyped_data(), n, isz, mask.typed_data(), offsets, chunk_size,
                          nchunks, y->untyped_data());
  }
  if (st.ok()) {
    st = LaunchZeroPackedTail(stream, mask.typed_data(), offsets, nchunks, chunk_size, n, n, isz,
                              y->untyped_data());
  }
  return ToError(st);
}

// y = x, except selected chunk c = packed[chunk c's packed position].
ffi::Error UnpackImpl(cudaStream_t stream, ffi::Context ctx, ffi::AnyBuffer packed,
                      ffi::AnyBuffer x, ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::AnyBuffer> y,
                      int64_t chunk_size) {
  Scratch scratch(ctx);  // freed when the handler returns
  size_t isz = 0;
  if (auto err = CheckChunks("unpack_chunks", x, mask, chunk_size, &isz); !err.success()) {
    return err;
  }
  if (packed.element_type() != x.element_type() || y->element_type() != x.element_type() ||
      packed.element_count() != x.element_count() || y->element_count() != x.element_count()) {
    return Invalid("unpack_chunks", "packed, x and y must match");
  }
  const size_t n = x.element_count();
  if (n == 0) return ffi::Error::Success();
  const int64_t nchunks = mask.element_count();
  Status st = FromCuda(cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), n * isz,
                                       cudaMemcpyDeviceToDevice, stream),
                       "cudaMemcpyAsync");
  int32_t* offsets = nullptr;
  if (st.ok()) st = Offsets(stream, scratch, mask.typed_data(), nchunks, &offsets);
  if (st.ok()) {
    st = LaunchUnpackChunks(stream, packed.untyped_data(), n, isz, mask.typed_data(), offsets,
                            chunk_size, nchunks, y->untyped_data());
  }
  return ToError(st);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackChunksCuda, PackImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::Context>()            // scratch: chunk offsets
                                  .Arg<ffi::AnyBuffer>()          // x, n elements
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // chunk mask
                                  .Ret<ffi::AnyBuffer>()          // y: packed, zero tail
                                  .Attr<int64_t>("chunk_size"));  // elements per chunk

XLA_FFI_DEFINE_HANDLER_SYMBOL(UnpackChunksCuda, UnpackImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::Context>()            // scratch: chunk offsets
                                  .Arg<ffi::AnyBuffer>()          // packed, n elements
                                  .Arg<ffi::AnyBuffer>()          // x: the unselected values
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // chunk mask
                                  .Ret<ffi::AnyBuffer>()          // y, like x
                                  .Attr<int64_t>("chunk_size"));  // elements per chunk

}  // namespace jaxcomm::cuda
