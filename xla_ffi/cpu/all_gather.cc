// all_gather for the CPU FFI backend: every rank's m elements, in rank order.
#include <memory>

#include "algorithm/schedule.h"
#include "cpu/async.h"
#include "cpu/collective.h"
#include "cpu/ffi_util.h"

namespace jaxcomm::cpu {
namespace {

ffi::Future AllGatherImpl(ffi::RunId run_id, int32_t device, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y,
                          int64_t op_id, int32_t nranks, int32_t wire_dtype) {
  DType input, wire;
  if (auto err = DecodeTypes("all_gather", x.element_type(), wire_dtype, &input, &wire);
      !err.success()) {
    return CompletedFuture(err);
  }
  if (coords.element_count() < 2) {
    return CompletedFuture(
        ffi::Error::InvalidArgument("jaxcomm all_gather: coords must hold [group, rank]"));
  }
  const size_t m = x.element_count();
  if (y->element_count() != m * static_cast<size_t>(nranks)) {
    return CompletedFuture(ffi::Error::InvalidArgument(
        "jaxcomm all_gather: output must hold nranks * " + std::to_string(m) + " elements"));
  }
  const CallSite site{
      "all_gather",
      run_id.run_id,
      op_id,
      device,
      coords.typed_data()[0],
      coords.typed_data()[1],
      nranks,
      1,
      Algorithm::kRing,
      Fingerprint({3, static_cast<int64_t>(m), static_cast<int>(input), static_cast<int>(wire)})};
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  return RunCollectiveAsync(site, [=](Rings& rings) -> Status {
    std::unique_ptr<char[]> scratch(new char[AllGatherScratchBytes(m, input, wire, nranks) + 1]);
    return RingAllGather(*rings.flat, CpuKernels::Get(), input, wire, in, out, m, scratch.get());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherCpu, AllGatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()          // shared by one execution's devices
                                  .Ctx<ffi::DeviceOrdinal>()  // for stats and messages
                                  .Arg<ffi::AnyBuffer>()      // x: m elements
                                  .Arg<ffi::Buffer<ffi::S32>>()   // coords: [group, rank]
                                  .Ret<ffi::AnyBuffer>()          // y: nranks * m elements
                                  .Attr<int64_t>("op_id")         // call site
                                  .Attr<int32_t>("nranks")        // ranks on the gathered axes
                                  .Attr<int32_t>("wire_dtype"));  // DType code, -1 = input dtype

}  // namespace jaxcomm::cpu
