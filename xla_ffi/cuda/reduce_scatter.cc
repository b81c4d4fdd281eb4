// reduce_scatter for the CUDA FFI backend: the flat input, zero-padded to a
// multiple of N, is summed over a ring of NCCL send/recv and rank r keeps
// elements [r*S, (r+1)*S).

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

ffi::Error ReduceScatterImpl(cudaStream_t stream, ffi::Context ctx, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y,
                             int32_t nranks, int32_t wire_dtype, double prescale, double postscale,
                             const CommRunner& run) {
  Scratch scratch(ctx);  // freed when the handler returns
  ReduceSpec spec;
  if (auto err = CheckReduceScatter(x, coords, *y, nranks, wire_dtype, prescale, postscale, &spec);
      !err.success()) {
    return err;
  }
  const size_t n = x.element_count();
  Status st = run([&](const CommSet& set, CudaKernels& k) {
    void* block = nullptr;
    JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(ReduceScatterScratchBytes(n, spec, nranks), &block));
    NcclTransport flat(set, set.flat, set.rank, set.size, stream);
    return RingReduceScatter(flat, k, spec, x.untyped_data(), y->untyped_data(), n, block);
  });
  return ToError(st);
}

ffi::Error ReduceScatterOwn(cudaStream_t stream, int32_t device, ffi::Context ctx, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y,
                            int64_t op_id, int32_t nranks, int32_t wire_dtype, double prescale,
                            double postscale) {
  return ReduceScatterImpl(stream, ctx, x, coords, y, nranks, wire_dtype, prescale, postscale,
                           [&](const CollectiveBody& body) {
                             return RunOnOwnComms(stream, device, coords.typed_data(), op_id,
                                                  nranks, body);
                           });
}

#if JAXCOMM_XLA_COMMS
ffi::Error ReduceScatterXla(cudaStream_t stream, int32_t device, ffi::Context ctx,
                            XlaCommContext comms, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> coords,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> group_ids,
                            int32_t nranks, int32_t wire_dtype, double prescale, double postscale) {
  Groups groups;
  if (Status st = GroupsFromFlat(group_ids.begin(), group_ids.size(), nranks, &groups); !st.ok()) {
    return ToError(st);
  }
  return ReduceScatterImpl(stream, ctx, x, coords, y, nranks, wire_dtype, prescale, postscale,
                           [&](const CollectiveBody& body) {
                             return RunOnXlaComms(stream, device, comms, groups,
                                                  coords.typed_data(), nranks, body);
                           });
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceScatterCuda, ReduceScatterOwn,
                              BindReduceScatter<Site::kOpId>(BindCollectiveContexts()));

#if JAXCOMM_XLA_COMMS
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceScatterCudaXlaComms, ReduceScatterXla,
                              BindReduceScatter<Site::kGroups>(BindCollectiveContextsXlaComms()));
#endif

}  // namespace jaxcomm::cuda
