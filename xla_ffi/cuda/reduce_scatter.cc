// reduce_scatter for the CUDA FFI backend: the flat input, zero-padded to a
// multiple of N, is summed over a ring of NCCL send/recv and rank r keeps
// elements [r*S, (r+1)*S).
#include <cuda_runtime_api.h>

#include "cpu/ffi_util.h"  // dtype decoding and Status -> ffi::Error; no CPU code
#include "cuda/collective.h"
#include "cuda/handlers.h"
#include "cuda/nccl_transport.h"
#include "cuda/scratch.h"

namespace jaxcomm::cuda {
namespace {

ffi::Error ReduceScatterImpl(cudaStream_t stream, int32_t device, ffi::Context ctx,
                             ffi::AnyBuffer x, ffi::Buffer<ffi::S32> coords,
                             ffi::Result<ffi::AnyBuffer> y, int64_t op_id, int32_t nranks,
                             int32_t wire_dtype, double prescale, double postscale) {
  Scratch scratch(ctx);  // freed when the handler returns
  ReduceSpec spec;
  if (auto err =
          cpu::DecodeTypes("reduce_scatter", x.element_type(), wire_dtype, &spec.input, &spec.wire);
      !err.success()) {
    return err;
  }
  spec.prescale = prescale;
  spec.postscale = postscale;
  if (coords.element_count() < 2) {
    return ffi::Error::InvalidArgument("jaxcomm reduce_scatter: coords must hold [group, rank]");
  }
  const size_t n = x.element_count();
  const size_t shard = nranks > 0 ? (n + nranks - 1) / nranks : 0;
  if (y->element_count() != shard) {
    return ffi::Error::InvalidArgument("jaxcomm reduce_scatter: output must hold " +
                                       std::to_string(shard) + " elements");
  }
  Status st = RunCollective(
      stream, device, coords.typed_data(), op_id, nranks, [&](RankComms& rc, CudaKernels& k) {
        void* block = nullptr;
        JAXCOMM_RETURN_IF_ERROR(
            scratch.Allocate(ReduceScatterScratchBytes(n, spec, nranks), &block));
        NcclTransport flat(rc, rc.flat, rc.rank, rc.size, stream);
        return RingReduceScatter(flat, k, spec, x.untyped_data(), y->untyped_data(), n, block);
      });
  return cpu::ToError(st);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceScatterCuda, ReduceScatterImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()     // picks the communicator
                                  .Ctx<ffi::Context>()           // scratch: accumulator and staging
                                  .Arg<ffi::AnyBuffer>()         // x, any shape, n elements
                                  .Arg<ffi::Buffer<ffi::S32>>()  // coords: [group, rank]
                                  .Ret<ffi::AnyBuffer>()         // y: ceil(n / nranks) elements
                                  .Attr<int64_t>("op_id")        // call site
                                  .Attr<int32_t>("nranks")       // ranks on the reduced axes
                                  .Attr<int32_t>("wire_dtype")   // DType code, -1 = input dtype
                                  .Attr<double>("prescale")      // before the wire cast
                                  .Attr<double>("postscale"));   // after the reduction

}  // namespace jaxcomm::cuda
