// allreduce for the CUDA FFI backend: ring or hierarchical over NCCL
// send/recv (float32 adds at every hop whatever the wire type), or
// ncclAllReduce for "direct" without a wire cast; optionally restricted to
// the chunks a mask selects (pack, reduce, unpack in one call).

#include <algorithm>

#include "common/ffi_bindings.h"
#include "common/ffi_contract.h"
#include "cuda/check.h"
#include "cuda/collective.h"
#include "cuda/handlers.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"
#include "cuda/xla_comms.h"

namespace jaxcomm::cuda {
namespace {

ffi::Error AllReduceImpl(cudaStream_t stream, ffi::Context ctx, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> coords, ffi::Buffer<ffi::PRED> mask,
                         ffi::Result<ffi::AnyBuffer> y, const ReductionAttrs& r,
                         const ChunkMaskAttrs& m, const CommRunner& run) {
  Scratch scratch(ctx);  // freed when the handler returns
  ReduceSpec spec;
  int64_t nchunks = 0, slots = 0;
  if (auto err = CheckAllReduce(x, coords, mask, *y, r, m, &spec, &nchunks, &slots);
      !err.success()) {
    return err;
  }
  const int32_t intra_size = r.intra_size;
  const int64_t chunk_size = m.chunk_size;
  const size_t n = x.element_count();
  const size_t isz = SizeOf(spec.input);
  const bool masked = nchunks > 0;
  const auto algo = static_cast<Algorithm>(r.algorithm);
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  Status st = run([&](const CommSet& set, CudaKernels& k) {
    if (!masked) {
      return ReduceContiguous(set, k, stream, scratch, algo, intra_size, spec, in, out, n);
    }
    // Only the selected chunks travel; the others keep the local values or
    // are zeroed.
    // NCCL takes its sizes from the host and the mask lives on the device,
    // so the packed buffer has a fixed size, `slots` chunks, zero-padded
    // past the selected ones: nothing waits for the device to count them.
    const bool* selected = mask.typed_data();
    const size_t packed = std::min(n, static_cast<size_t>(slots * chunk_size));
    if (static_cast<Unselected>(m.unselected) == Unselected::kZero) {
      k.Zero(out, n * isz);
    } else {
      k.Convert(out, spec.input, in, spec.input, n, 1.0);
    }
    void *offsets, *packed_in, *packed_out;
    JAXCOMM_RETURN_IF_ERROR(scratch.Allocate((nchunks + 1) * sizeof(int32_t), &offsets));
    JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(packed * isz, &packed_in));
    JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(packed * isz, &packed_out));
    auto* chunk_offsets = static_cast<int32_t*>(offsets);
    JAXCOMM_RETURN_IF_ERROR(LaunchChunkOffsets(stream, selected, nchunks, chunk_offsets));
    JAXCOMM_RETURN_IF_ERROR(LaunchPackChunks(stream, in, n, isz, selected, chunk_offsets,
                                             chunk_size, slots, packed_in));
    JAXCOMM_RETURN_IF_ERROR(LaunchZeroPackedTail(stream, selected, chunk_offsets, nchunks,
                                                 chunk_size, n, packed, isz, packed_in));
    JAXCOMM_RETURN_IF_ERROR(ReduceContiguous(set, k, stream, scratch, algo, intra_size, spec,
                                             packed_in, packed_out, packed));
    return LaunchUnpackChunks(stream, packed_out, n, isz, selected, chunk_offsets, chunk_size,
                              slots, out);
  });
  return ToError(st);
}

// jaxcomm's own communicators, found by call site.
ffi::Error AllReduceOwn(cudaStream_t stream, int32_t device, ffi::Context ctx, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> coords, ffi::Buffer<ffi::PRED> mask,
                        ffi::Result<ffi::AnyBuffer> y, AllReduceAttrs<Site::kOpId> attrs) {
  return AllReduceImpl(stream, ctx, x, coords, mask, y, attrs.reduction, attrs.mask,
                       [&](const CollectiveBody& body) {
                         return RunOnOwnComms(stream, device, coords.typed_data(), attrs.at,
                                              attrs.reduction.nranks, body);
                       });
}

#if JAXCOMM_XLA_COMMS
// XLA's communicators for the call's device groups.
ffi::Error AllReduceXla(cudaStream_t stream, int32_t device, ffi::Context ctx, XlaCommContext comms,
                        ffi::AnyBuffer x, ffi::Buffer<ffi::S32> coords, ffi::Buffer<ffi::PRED> mask,
                        ffi::Result<ffi::AnyBuffer> y, AllReduceAttrs<Site::kGroups> attrs) {
  const int32_t nranks = attrs.reduction.nranks;
  Groups groups;
  if (Status st = GroupsFromFlat(attrs.at.begin(), attrs.at.size(), nranks, &groups); !st.ok()) {
    return ToError(st);
  }
  return AllReduceImpl(stream, ctx, x, coords, mask, y, attrs.reduction, attrs.mask,
                       [&](const CollectiveBody& body) {
                         return RunOnXlaComms(stream, device, comms, groups, coords.typed_data(),
                                              nranks, body);
                       });
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceCuda, AllReduceOwn,
                              BindAllReduce<Site::kOpId>(BindCollectiveContexts()));

#if JAXCOMM_XLA_COMMS
XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceCudaXlaComms, AllReduceXla,
                              BindAllReduce<Site::kGroups>(BindCollectiveContextsXlaComms()));
#endif

}  // namespace jaxcomm::cuda
