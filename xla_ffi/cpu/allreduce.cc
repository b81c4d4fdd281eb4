// allreduce for the CPU FFI backend: ring, hierarchical or direct, optionally
// restricted to the chunks a mask selects (pack, reduce, unpack in one call).
#include "cpu/allreduce.h"

#include <cstring>
#include <memory>
#include <vector>

#include "algorithm/schedule.h"
#include "common/chunk_layout.h"
#include "common/codes.h"
#include "common/ffi_bindings.h"
#include "common/ffi_contract.h"
#include "cpu/async.h"
#include "cpu/collective.h"
#include "cpu/cpu_kernels.h"
#include "cpu/direct.h"

namespace jaxcomm::cpu {

Status ReduceContiguous(Rings& rings, Algorithm algorithm, const ReduceSpec& spec, const void* in,
                        void* out, size_t n) {
  Kernels& k = CpuKernels::Get();
  switch (algorithm) {
    case Algorithm::kDirect:
      break;  // no thread of it blocks: ArriveDirect, not a Rings body
    case Algorithm::kRing: {
      std::unique_ptr<char[]> scratch(new char[AllReduceScratchBytes(n, spec, rings.flat->size())]);
      return RingAllReduce(*rings.flat, k, spec, in, out, n, scratch.get());
    }
    case Algorithm::kHierarchical: {
      std::unique_ptr<char[]> scratch(
          new char[AllReduceScratchBytes(n, spec, rings.intra->size())]);
      return HierarchicalAllReduce(*rings.intra, *rings.inter, k, spec, in, out, n, scratch.get());
    }
  }
  return Status(Code::kInvalidArgument,
                "jaxcomm allreduce: no blocking schedule for this algorithm");
}

Algorithm ScheduleOf(const CallSite& site) {
  return site.algorithm == Algorithm::kDirect && CrossesProcesses(site) ? Algorithm::kRing
                                                                        : site.algorithm;
}

void ArriveDirectThen(const CallSite& site, const ReduceSpec& spec, std::vector<size_t> parts,
                      std::vector<const void*> in, std::vector<void*> out,
                      std::function<void(const Status&)> done) {
  DirectCall call{{site.run_id, site.op_id, site.group, Ring::kFlat, 0},
                  site.nranks,
                  {site.op, site.fingerprint},
                  spec,
                  std::move(parts)};
  ArriveDirect(call, {site.rank, site.device, std::move(in), std::move(out), std::move(done)});
}

ffi::Future ArriveDirectFuture(const CallSite& site, const ReduceSpec& spec,
                               std::vector<size_t> parts, std::vector<const void*> in,
                               std::vector<void*> out, std::function<void()> on_success) {
  ffi::Promise promise;
  ffi::Future future(promise);
  auto complete = [promise, then = std::move(on_success)](const Status& st) mutable {
    if (!st.ok()) return promise.SetError(ToError(st));
    if (then) then();
    promise.SetAvailable();
  };
  ArriveDirectThen(site, spec, std::move(parts), std::move(in), std::move(out),
                   std::move(complete));
  return future;
}

std::vector<Range> SelectedChunks(const bool* mask, size_t nchunks, size_t chunk_size, size_t n,
                                  size_t slots) {
  std::vector<Range> ranges;
  for (size_t c = 0; c < nchunks && ranges.size() < slots; ++c) {
    if (mask[c]) ranges.push_back({c * chunk_size, c * chunk_size + ChunkLength(c, n, chunk_size)});
  }
  return ranges;
}

void Pack(const std::vector<Range>& chunks, const char* in, char* packed, size_t isz) {
  size_t at = 0;
  for (const Range& c : chunks) {
    std::memcpy(packed + at * isz, in + c.begin * isz, c.size() * isz);
    at += c.size();
  }
}

// Zeros are written only between the chunks: a pass over the whole output
// first would touch it twice.
void Unpack(const std::vector<Range>& chunks, const char* in, const char* packed, char* out,
            size_t n, size_t isz, bool zero) {
  if (!zero && out != in) std::memcpy(out, in, n * isz);
  size_t at = 0, end = 0;
  for (const Range& c : chunks) {
    if (zero) std::memset(out + end * isz, 0, (c.begin - end) * isz);
    std::memcpy(out + c.begin * isz, packed + at * isz, c.size() * isz);
    at += c.size();
    end = c.end;
  }
  if (zero) std::memset(out + end * isz, 0, (n - end) * isz);
}

namespace {

// The direct masked schedule: pack the selected chunks, reduce them
// directly, unpack them once the last rank has reduced.
ffi::Future AllReduceDirectMasked(const CallSite& site, const ReduceSpec& spec, const char* in,
                                  char* out, size_t n, const std::vector<Range>& chunks,
                                  size_t packed, bool zero) {
  const size_t isz = SizeOf(spec.input);
  std::shared_ptr<char[]> buffer(new char[std::max<size_t>(2 * packed, 1) * isz]);
  char* packed_in = buffer.get();
  char* packed_out = packed_in + packed * isz;
  Pack(chunks, in, packed_in, isz);
  return ArriveDirectFuture(site, spec, {packed}, {packed_in}, {packed_out}, [=] {
    Unpack(chunks, in, buffer.get() + packed * isz, out, n, isz, zero);
  });
}

ffi::Future AllReduceImpl(Caller caller, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> coords,
                          ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::AnyBuffer> y,
                          AllReduceAttrs<Site::kOpId> attrs) {
  const ReductionAttrs& r = attrs.reduction;
  const int64_t chunk_size = attrs.mask.chunk_size;
  ReduceSpec spec;
  int64_t nchunks = 0, slots = 0;
  if (auto err = CheckAllReduce(x, coords, mask, *y, r, attrs.mask, &spec, &nchunks, &slots);
      !err.success()) {
    return CompletedFuture(err);
  }
  const size_t n = x.element_count();
  const size_t isz = SizeOf(spec.input);
  const bool masked = nchunks > 0;
  const std::vector<Range> chunks =
      masked ? SelectedChunks(mask.typed_data(), nchunks, chunk_size, n, slots)
             : std::vector<Range>();
  size_t packed = 0;
  for (const Range& c : chunks) packed += c.size();

  CallSite site;
  if (Status st = SiteOf(
          "allreduce", caller, coords.typed_data(), PlacementOf(attrs.at, r),
          Fingerprint(OpTag::kAllReduce, {static_cast<int64_t>(n), static_cast<int>(spec.input),
                                          static_cast<int>(spec.wire), r.algorithm, r.intra_size,
                                          chunk_size, masked ? static_cast<int64_t>(packed) : -1,
                                          masked ? static_cast<int64_t>(chunks.size()) : -1}),
          &site);
      !st.ok()) {
    return CompletedFuture(ToError(st));
  }

  const char* in = static_cast<const char*>(x.untyped_data());
  char* out = static_cast<char*>(y->untyped_data());
  const Algorithm algo = ScheduleOf(site);
  // Only the selected chunks travel: pack them, reduce, unpack; the other
  // chunks keep the local values or are zeroed.
  const bool zero = static_cast<Unselected>(attrs.mask.unselected) == Unselected::kZero;
  if (algo == Algorithm::kDirect) {
    if (!masked) return ArriveDirectFuture(site, spec, {n}, {in}, {out});
    return AllReduceDirectMasked(site, spec, in, out, n, chunks, packed, zero);
  }
  return RunCollectiveAsync(site, [=](Rings& rings) -> Status {
    if (!masked) return ReduceContiguous(rings, algo, spec, in, out, n);
    std::unique_ptr<char[]> buffer(new char[std::max<size_t>(2 * packed, 1) * isz]);
    char* packed_in = buffer.get();
    char* packed_out = packed_in + packed * isz;
    Pack(chunks, in, packed_in, isz);
    JAXCOMM_RETURN_IF_ERROR(ReduceContiguous(rings, algo, spec, packed_in, packed_out, packed));
    Unpack(chunks, in, packed_out, out, n, isz, zero);
    return Status::Ok();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceCpu, AllReduceImpl,
                              BindAllReduce<Site::kOpId>(ffi::Ffi::Bind().Ctx<Caller>()));

}  // namespace jaxcomm::cpu
