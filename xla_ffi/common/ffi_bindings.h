// The operands and attributes of each collective handler, written once: a
// platform's binding starts with its own contexts (RunId on CPU, the stream
// on CUDA, ...) and hands it to Bind<Op><Site>, which appends the rest. The
// handler then takes, after its contexts:
//   allreduce:      x, coords, mask, y, <site>, algorithm, nranks, intra_size,
//                   wire_dtype, prescale, postscale, chunk_size, max_chunks,
//                   unselected
//   reduce_scatter: x, coords, y, <site>, nranks, wire_dtype, prescale, postscale
//   all_gather:     x, coords, y, <site>, nranks, wire_dtype
// <site> names the call's ranks: "op_id" (int64, same on every device of a
// call site) where jaxcomm finds the ranks itself, "groups" (the flattened
// device ids of every group) where XLA lends its communicators.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

enum class Site { kOpId, kGroups };

namespace bindings {

namespace ffi = xla::ffi;

template <Site site, typename B>
auto SiteAttr(B&& b) {
  if constexpr (site == Site::kOpId) {
    return std::move(b).template Attr<int64_t>("op_id");
  } else {
    return std::move(b).template Attr<ffi::Span<const int64_t>>("groups");
  }
}

}  // namespace bindings

template <Site site, typename B>
auto BindAllReduce(B&& b) {
  namespace ffi = xla::ffi;
  auto operands = std::move(b)
                      .template Arg<ffi::AnyBuffer>()          // x
                      .template Arg<ffi::Buffer<ffi::S32>>()   // coords: [group, rank]
                      .template Arg<ffi::Buffer<ffi::PRED>>()  // chunk mask; empty = all
                      .template Ret<ffi::AnyBuffer>();         // y, x's shape and dtype
  return bindings::SiteAttr<site>(std::move(operands))
      .template Attr<int32_t>("algorithm")    // Algorithm code
      .template Attr<int32_t>("nranks")       // ranks on the reduced axes
      .template Attr<int32_t>("intra_size")   // hierarchical: ranks per node
      .template Attr<int32_t>("wire_dtype")   // DType code, -1 = input dtype
      .template Attr<double>("prescale")      // before the wire cast
      .template Attr<double>("postscale")     // after the reduction
      .template Attr<int64_t>("chunk_size")   // mask granularity, elements
      .template Attr<int64_t>("max_chunks")   // mask: chunk slots packed, 0 = all
      .template Attr<int32_t>("unselected");  // mask: Unselected code (local values or zeros)
}

template <Site site, typename B>
auto BindReduceScatter(B&& b) {
  namespace ffi = xla::ffi;
  auto operands = std::move(b)
                      .template Arg<ffi::AnyBuffer>()         // x, n elements
                      .template Arg<ffi::Buffer<ffi::S32>>()  // coords: [group, rank]
                      .template Ret<ffi::AnyBuffer>();        // y: ceil(n / nranks) elements
  return bindings::SiteAttr<site>(std::move(operands))
      .template Attr<int32_t>("nranks")      // ranks on the reduced axes
      .template Attr<int32_t>("wire_dtype")  // DType code, -1 = input dtype
      .template Attr<double>("prescale")     // before the wire cast
      .template Attr<double>("postscale");   // after the reduction
}

template <Site site, typename B>
auto BindAllGather(B&& b) {
  namespace ffi = xla::ffi;
  auto operands = std::move(b)
                      .template Arg<ffi::AnyBuffer>()         // x: m elements
                      .template Arg<ffi::Buffer<ffi::S32>>()  // coords: [group, rank]
                      .template Ret<ffi::AnyBuffer>();        // y: nranks * m elements
  return bindings::SiteAttr<site>(std::move(operands))
      .template Attr<int32_t>("nranks")       // ranks on the gathered axes
      .template Attr<int32_t>("wire_dtype");  // DType code, -1 = input dtype
}

}  // namespace jaxcomm
