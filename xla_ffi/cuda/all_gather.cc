// all_gather for the CUDA FFI backend: every rank's m elements, in rank
// order, over a ring of NCCL send/recv in the wire type.

#include "common/ffi_bindings.h"
#include "common/ffi_contract.h"
#include "cuda/collective.h"
#include "cuda/handlers.h"
#include "cuda/nccl_transport.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"
#include "cuda/xla_comms.h"

namespace jaxcomm::cuda {
namespace {

ffi::Error AllGatherImpl(cudaStream_t stream, ffi::Context ctx, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y,
                         int32_t nranks, int32_t wire_dtype, const CommRunner& run) {
  Scratch scratch(ctx);  // freed when the handler returns
  DType input, wire;
  if (auto err = CheckAllGather(x, coords, *y, nranks, wire_dtype, &input, &wire); !err.success()) {
    return err;
  }
  const size_t m = x.element_count();
  Status st = run([&](const CommSet& set, CudaKernels& k) {
    void* block = nullptr;
    JAXCOMM_RETURN_IF_ERROR(
        scratch.Allocate(AllGatherScratchBytes(m, input, wire, nranks), &block));
    NcclTransport flat(set, set.flat, set.rank, set.size, stream);
    return RingAllGather(flat, k, input, wire, x.untyped_data(), y->untyped_data(), m, block);
  });
  return ToError(st);
}

ffi::Error AllGatherOwn(cudaStream_t stream, int32_t device, ffi::Context ctx, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y, int64_t op_id,
                        int32_t nranks, int32_t wire_dtype) {
  return AllGatherImpl(
      stream, ctx, x, coords, y, nranks, wire_dtype, [&](const CollectiveBody& body) {
        return RunOnOwnComms(stream, device, coords.typed_data(), op_id, nranks, body);
      });
}

#if JAXCOMM_XLA_COMMS
ffi::Error AllGatherXla(cudaStream_t stream, int32_t device, ffi::Context ctx, XlaCommContext comms,
                        ffi::AnyBuffer x, ffi::Buffer<ffi::S32> coords,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> group_ids,
                        int32_t nranks, int32_t wire_dtype) {
  Groups groups;
  if (Status st = GroupsFromFlat(group_ids.begin(), group_ids.size(), nranks, &groups); !st.ok()) {
    return ToError(st);
  }
  return AllGatherImpl(
      stream, ctx, x, coords, y, nranks, wire_dtype, [&](const CollectiveBody& body) {
        return RunOnXlaComms(stream, device, comms, groups, coords.typed_data(), nranks, body);
      });
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherCuda, AllGatherOwn,
                              BindAllGather<Site::kOpId>(BindCollectiveContexts()));

#if JAXCOMM_XLA_COMMS
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherCudaXlaComms, AllGatherXla,
                              BindAllGather<Site::kGroups>(BindCollectiveContextsXlaComms()));
#endif

}  // namespace jaxcomm::cuda
