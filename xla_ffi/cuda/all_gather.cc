// all_gather for the CUDA FFI backend: every rank's m elements, in rank
// order, over a ring of NCCL send/recv in the wire type.
#include <cuda_runtime_api.h>

#include "cpu/ffi_util.h"  // dtype decoding and Status -> ffi::Error; no CPU code
#include "cuda/collective.h"
#include "cuda/handlers.h"
#include "cuda/nccl_transport.h"
#include "cuda/scratch.h"

namespace jaxcomm::cuda {
namespace {

ffi::Error AllGatherImpl(cudaStream_t stream, int32_t device, ffi::Context ctx, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y, int64_t op_id,
                         int32_t nranks, int32_t wire_dtype) {
  Scratch scratch(ctx);  // freed when the handler returns
  DType input, wire;
  if (auto err = cpu::DecodeTypes("all_gather", x.element_type(), wire_dtype, &input, &wire);
      !err.success()) {
    return err;
  }
  if (coords.element_count() < 2) {
    return ffi::Error::InvalidArgument("jaxcomm all_gather: coords must hold [group, rank]");
  }
  const size_t m = x.element_count();
  if (nranks < 1 || y->element_count() != m * static_cast<size_t>(nranks)) {
    return ffi::Error::InvalidArgument("jaxcomm all_gather: output must hold nranks * " +
                                       std::to_string(m) + " elements");
  }
  Status st = RunCollective(
      stream, device, coords.typed_data(), op_id, nranks, [&](RankComms& rc, CudaKernels& k) {
        void* block = nullptr;
        JAXCOMM_RETURN_IF_ERROR(
            scratch.Allocate(AllGatherScratchBytes(m, input, wire, nranks), &block));
        NcclTransport flat(rc, rc.flat, rc.rank, rc.size, stream);
        return RingAllGather(flat, k, input, wire, x.untyped_data(), y->untyped_data(), m, block);
      });
  return cpu::ToError(st);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherCuda, AllGatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()  // picks the communicator
                                  .Ctx<ffi::Context>()        // scratch: wire-typed gather buffer
                                  .Arg<ffi::AnyBuffer>()      // x: m elements
                                  .Arg<ffi::Buffer<ffi::S32>>()   // coords: [group, rank]
                                  .Ret<ffi::AnyBuffer>()          // y: nranks * m elements
                                  .Attr<int64_t>("op_id")         // call site
                                  .Attr<int32_t>("nranks")        // ranks on the gathered axes
                                  .Attr<int32_t>("wire_dtype"));  // DType code, -1 = input dtype

}  // namespace jaxcomm::cuda
