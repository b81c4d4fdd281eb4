// allreduce_parts for the CPU FFI backend: one allreduce over several
// buffers (a bucket of gradient leaves), each reduced into its own result.
//
// A bucket was a concatenate before the call and a slice per leaf after it;
// XLA's CPU code for the concatenate cost more than the reduction itself
// (bench/overhead.py, ResNet-50's leaves in 4 MiB buckets). The direct
// schedule reads every rank's parts where they lie and writes every result
// once. The ring and hierarchical schedules need one contiguous buffer: they
// copy the parts together in the handler, as the concatenate did.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "algorithm/schedule.h"
#include "common/ffi_contract.h"
#include "cpu/allreduce.h"
#include "cpu/async.h"
#include "cpu/collective.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

namespace ffi = xla::ffi;

// Each part's input and result, checked to agree with the first input.
struct Parts {
  std::vector<const void*> in;
  std::vector<void*> out;
  std::vector<size_t> sizes;
  size_t n = 0;
};

constexpr char kOp[] = "allreduce_parts";

ffi::Error CollectParts(ffi::RemainingArgs xs, ffi::RemainingRets ys, Parts* parts) {
  if (xs.size() == 0) return Invalid(kOp, "no parts");
  if (xs.size() != ys.size()) {
    return Invalid(
        kOp, std::to_string(xs.size()) + " inputs but " + std::to_string(ys.size()) + " results");
  }
  ffi::DataType dtype = ffi::DataType::INVALID;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto x = xs.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (y.has_error()) return y.error();
    if (i == 0) dtype = x->element_type();
    if (x->element_type() != dtype) {
      return Invalid(kOp, "part " + std::to_string(i) + " has another dtype than part 0");
    }
    if ((*y)->element_type() != dtype || (*y)->element_count() != x->element_count()) {
      return Invalid(kOp, "result " + std::to_string(i) + " must have part " + std::to_string(i) +
                              "'s dtype and size");
    }
    parts->in.push_back(x->untyped_data());
    parts->out.push_back((*y)->untyped_data());
    parts->sizes.push_back(x->element_count());
    parts->n += x->element_count();
  }
  return ffi::Error::Success();
}

ffi::Future AllReducePartsImpl(Caller caller, ffi::Buffer<ffi::S32> coords, ffi::RemainingArgs xs,
                               ffi::RemainingRets ys, ReductionAtOpId attrs) {
  const ReductionAttrs& r = attrs.reduction;
  Parts parts;
  if (auto err = CollectParts(xs, ys, &parts); !err.success()) return CompletedFuture(err);
  ReduceSpec spec;
  auto first = xs.get<ffi::AnyBuffer>(0);
  if (auto err = DecodeReduction(kOp, *first, coords, r, &spec); !err.success()) {
    return CompletedFuture(err);
  }
  // The ranks must agree on every part's size, not only on the total.
  uint64_t sizes = Fingerprint({static_cast<int64_t>(parts.sizes.size())});
  for (size_t size : parts.sizes)
    sizes = Fingerprint({static_cast<int64_t>(sizes), static_cast<int64_t>(size)});
  CallSite site;
  if (Status st = SiteOf(kOp, caller, coords.typed_data(), PlacementOf(attrs.op_id, r),
                         Fingerprint(OpTag::kAllReduceParts,
                                     {static_cast<int64_t>(parts.n), static_cast<int>(spec.input),
                                      static_cast<int>(spec.wire), r.algorithm, r.intra_size,
                                      static_cast<int64_t>(sizes)}),
                         &site);
      !st.ok()) {
    return CompletedFuture(ToError(st));
  }
  const Algorithm algo = ScheduleOf(site);
  if (algo == Algorithm::kDirect) {
    return ArriveDirectFuture(site, spec, parts.sizes, parts.in, parts.out);
  }
  return RunCollectiveAsync(site, [=](Rings& rings) -> Status {
    const size_t isz = SizeOf(spec.input);
    // Input and output apart: a ring's peers may read this rank's input
    // while it writes its output.
    std::unique_ptr<char[]> flat(new char[std::max<size_t>(2 * parts.n, 1) * isz]);
    char* flat_in = flat.get();
    char* flat_out = flat_in + parts.n * isz;
    size_t at = 0;
    for (size_t i = 0; i < parts.sizes.size(); ++i) {
      std::memcpy(flat_in + at * isz, parts.in[i], parts.sizes[i] * isz);
      at += parts.sizes[i];
    }
    JAXCOMM_RETURN_IF_ERROR(ReduceContiguous(rings, algo, spec, flat_in, flat_out, parts.n));
    at = 0;
    for (size_t i = 0; i < parts.sizes.size(); ++i) {
      std::memcpy(parts.out[i], flat_out + at * isz, parts.sizes[i] * isz);
      at += parts.sizes[i];
    }
    return Status::Ok();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReducePartsCpu, AllReducePartsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<Caller>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // coords: [group, rank]
                                  .RemainingArgs()               // the parts, any shapes
                                  .RemainingRets()               // one result per part
                                  .Attrs<ReductionAtOpId>());

}  // namespace jaxcomm::cpu
