// all_gather for the CPU FFI backend: every rank's m elements, in rank order.
#include <memory>

#include "algorithm/schedule.h"
#include "common/ffi_bindings.h"
#include "common/ffi_contract.h"
#include "cpu/async.h"
#include "cpu/collective.h"
#include "cpu/cpu_kernels.h"

namespace jaxcomm::cpu {
namespace {

ffi::Future AllGatherImpl(Caller caller, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> coords,
                          ffi::Result<ffi::AnyBuffer> y, int64_t op_id, int32_t nranks,
                          int32_t wire_dtype) {
  DType input, wire;
  if (auto err = CheckAllGather(x, coords, *y, nranks, wire_dtype, &input, &wire); !err.success()) {
    return CompletedFuture(err);
  }
  const size_t m = x.element_count();
  CallSite site;
  if (Status st = SiteOf(
          "all_gather", caller, coords.typed_data(), {op_id, nranks},
          Fingerprint(OpTag::kAllGather,
                      {static_cast<int64_t>(m), static_cast<int>(input), static_cast<int>(wire)}),
          &site);
      !st.ok()) {
    return CompletedFuture(ToError(st));
  }
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  return RunCollectiveAsync(site, [=](Rings& rings) -> Status {
    std::unique_ptr<char[]> scratch(new char[AllGatherScratchBytes(m, input, wire, nranks) + 1]);
    return RingAllGather(*rings.flat, CpuKernels::Get(), input, wire, in, out, m, scratch.get());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherCpu, AllGatherImpl,
                              BindAllGather<Site::kOpId>(ffi::Ffi::Bind().Ctx<Caller>()));

}  // namespace jaxcomm::cpu
