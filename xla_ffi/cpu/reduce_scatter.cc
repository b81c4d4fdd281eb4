// reduce_scatter for the CPU FFI backend: the flat input, zero-padded to a
// multiple of N, is summed and rank r keeps elements [r*S, (r+1)*S).
#include <memory>

#include "algorithm/schedule.h"
#include "cpu/async.h"
#include "cpu/collective.h"
#include "cpu/ffi_util.h"

namespace jaxcomm::cpu {
namespace {

ffi::Future ReduceScatterImpl(ffi::RunId run_id, int32_t device, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y,
                              int64_t op_id, int32_t nranks, int32_t wire_dtype, double prescale,
                              double postscale) {
  ReduceSpec spec;
  if (auto err =
          DecodeTypes("reduce_scatter", x.element_type(), wire_dtype, &spec.input, &spec.wire);
      !err.success()) {
    return CompletedFuture(err);
  }
  spec.prescale = prescale;
  spec.postscale = postscale;
  if (coords.element_count() < 2) {
    return CompletedFuture(
        ffi::Error::InvalidArgument("jaxcomm reduce_scatter: coords must hold [group, rank]"));
  }
  const size_t n = x.element_count();
  const size_t shard = nranks > 0 ? (n + nranks - 1) / nranks : 0;
  if (y->element_count() != shard) {
    return CompletedFuture(ffi::Error::InvalidArgument("jaxcomm reduce_scatter: output must hold " +
                                                       std::to_string(shard) + " elements"));
  }
  const CallSite site{"reduce_scatter",
                      run_id.run_id,
                      op_id,
                      device,
                      coords.typed_data()[0],
                      coords.typed_data()[1],
                      nranks,
                      1,
                      Algorithm::kRing,
                      Fingerprint({2, static_cast<int64_t>(n), static_cast<int>(spec.input),
                                   static_cast<int>(spec.wire)})};
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  return RunCollectiveAsync(site, [=](Rings& rings) -> Status {
    std::unique_ptr<char[]> scratch(new char[ReduceScatterScratchBytes(n, spec, nranks)]);
    return RingReduceScatter(*rings.flat, CpuKernels::Get(), spec, in, out, n, scratch.get());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceScatterCpu, ReduceScatterImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()          // shared by one execution's devices
                                  .Ctx<ffi::DeviceOrdinal>()  // for stats and messages
                                  .Arg<ffi::AnyBuffer>()      // x, any shape, n elements
                                  .Arg<ffi::Buffer<ffi::S32>>()  // coords: [group, rank]
                                  .Ret<ffi::AnyBuffer>()         // y: ceil(n / nranks) elements
                                  .Attr<int64_t>("op_id")        // call site
                                  .Attr<int32_t>("nranks")       // ranks on the reduced axes
                                  .Attr<int32_t>("wire_dtype")   // DType code, -1 = input dtype
                                  .Attr<double>("prescale")      // before the wire cast
                                  .Attr<double>("postscale"));   // after the reduction

}  // namespace jaxcomm::cpu
