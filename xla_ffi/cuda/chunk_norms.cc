// chunk_norms: the L1 norm of every chunk of a flat gradient, the score CSC
// ranks chunks by when it picks the next mask.

#include "common/ffi_contract.h"
#include "cuda/handlers.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"

namespace jaxcomm::cuda {
namespace {

namespace ffi = xla::ffi;

ffi::Error ChunkNormsImpl(cudaStream_t stream, ffi::AnyBuffer x,
                          ffi::Result<ffi::Buffer<ffi::F32>> norms, int64_t chunk_size) {
  constexpr const char* kOp = "chunk_norms";
  DType type;
  if (auto err = DecodeInput(kOp, x.element_type(), &type); !err.success()) return err;
  const size_t n = x.element_count();
  int64_t nchunks = 0;
  if (auto err = CountChunks(kOp, n, chunk_size, &nchunks); !err.success()) return err;
  if (static_cast<int64_t>(norms->element_count()) != nchunks) {
    return Invalid(kOp, "output must hold " + std::to_string(nchunks) + " norms");
  }
  return ToError(
      LaunchChunkL1Norms(stream, x.untyped_data(), type, n, chunk_size, norms->typed_data()));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkNormsCuda, ChunkNormsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Arg<ffi::AnyBuffer>()                     // x, n elements
                                  .Ret<ffi::Buffer<ffi::F32>>()   // norms: ceil(n / chunk_size)
                                  .Attr<int64_t>("chunk_size"));  // elements per chunk

}  // namespace jaxcomm::cuda
