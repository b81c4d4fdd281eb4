// reduce_scatter for the CPU FFI backend: the flat input, zero-padded to a
// multiple of N, is summed and rank r keeps elements [r*S, (r+1)*S).
#include <memory>

#include "algorithm/schedule.h"
#include "common/ffi_bindings.h"
#include "common/ffi_contract.h"
#include "cpu/async.h"
#include "cpu/collective.h"
#include "cpu/cpu_kernels.h"

namespace jaxcomm::cpu {
namespace {

ffi::Future ReduceScatterImpl(Caller caller, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> coords,
                              ffi::Result<ffi::AnyBuffer> y, int64_t op_id, int32_t nranks,
                              int32_t wire_dtype, double prescale, double postscale) {
  ReduceSpec spec;
  if (auto err = CheckReduceScatter(x, coords, *y, nranks, wire_dtype, prescale, postscale, &spec);
      !err.success()) {
    return CompletedFuture(err);
  }
  const size_t n = x.element_count();
  const uint64_t fingerprint = Fingerprint(
      OpTag::kReduceScatter,
      {static_cast<int64_t>(n), static_cast<int>(spec.input), static_cast<int>(spec.wire)});
  CallSite site;
  if (Status st = SiteOf("reduce_scatter", caller, coords.typed_data(), {op_id, nranks},
                         fingerprint, &site);
      !st.ok()) {
    return CompletedFuture(ToError(st));
  }
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  return RunCollectiveAsync(site, [=](Rings& rings) -> Status {
    std::unique_ptr<char[]> scratch(new char[ReduceScatterScratchBytes(n, spec, nranks)]);
    return RingReduceScatter(*rings.flat, CpuKernels::Get(), spec, in, out, n, scratch.get());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceScatterCpu, ReduceScatterImpl,
                              BindReduceScatter<Site::kOpId>(ffi::Ffi::Bind().Ctx<Caller>()));

}  // namespace jaxcomm::cpu
