// The operands and attributes of each collective handler, written once: a
// platform's binding starts with its own contexts (Caller on CPU, the stream
// on CUDA, ...) and hands it to Bind<Op><Site>, which appends the rest. The
// handler then takes, after its contexts:
//   allreduce:      x, coords, mask, y, AllReduceAttrs<site>
//   reduce_scatter: x, coords, y, <site>, nranks, wire_dtype, prescale, postscale
//   all_gather:     x, coords, y, <site>, nranks, wire_dtype
// <site> names the call's ranks: "op_id" (int64, same on every device of a
// call site) where jaxcomm finds the ranks itself, "groups" (the flattened
// device ids of every group) where XLA lends its communicators. The
// attributes that several handlers share are decoded into structs whose
// fields come from the lists of common/attr_lists.h.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/attr_lists.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

enum class Site { kOpId, kGroups };

// The attributes of JAXCOMM_REDUCTION_ATTRS and JAXCOMM_CHUNK_MASK_ATTRS.
struct ReductionAttrs {
  JAXCOMM_REDUCTION_ATTRS(JAXCOMM_ATTR_FIELD)
};
struct ChunkMaskAttrs {
  JAXCOMM_CHUNK_MASK_ATTRS(JAXCOMM_ATTR_FIELD)
};

// The <site> attribute's type.
template <Site site>
using SiteId = std::conditional_t<site == Site::kOpId, int64_t, xla::ffi::Span<const int64_t>>;

// allreduce's attributes, decoded as one (ffi::Binding::Attrs).
template <Site site>
struct AllReduceAttrs {
  SiteId<site> at;  // "op_id" or "groups"
  ReductionAttrs reduction;
  ChunkMaskAttrs mask;
};

// allreduce_parts' attributes (CPU).
struct ReductionAtOpId {
  int64_t op_id;
  ReductionAttrs reduction;
};

// allreduce_start's attributes (cpu/ and cuda/allreduce_async.cc):
// allreduce_parts' and this job's nonce, and the chunk mask's chunk size.
struct StartAttrs {
  int64_t op_id;  // same on every device
  ReductionAttrs reduction;
  int32_t nonce;
  int64_t chunk_size;  // of the chunk mask; unused without one
};

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
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::Buffer<ffi::S32>>()   // coords: [group, rank]
      .template Arg<ffi::Buffer<ffi::PRED>>()  // chunk mask; empty = all
      .template Ret<ffi::AnyBuffer>()          // y, x's shape and dtype
      .template Attrs<AllReduceAttrs<site>>();
}

// allreduce_start: x, coords, mask; returns the handle.
template <typename B>
auto BindAllReduceStart(B&& b) {
  namespace ffi = xla::ffi;
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::Buffer<ffi::S32>>()   // coords: [group, rank]
      .template Arg<ffi::Buffer<ffi::PRED>>()  // chunk mask; empty = all
      .template Ret<ffi::Buffer<ffi::S32>>()   // [nonce, op_id, sequence]
      .template Attrs<StartAttrs>();
}

// allreduce_done: the handle; returns the result and whether it was found.
template <typename B>
auto BindAllReduceDone(B&& b) {
  namespace ffi = xla::ffi;
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // handle from the start
      .template Ret<ffi::AnyBuffer>()         // y: the started x, reduced
      .template Ret<ffi::Buffer<ffi::S32>>()  // found: 1, or 0 (y unwritten)
      .template Attr<int32_t>("nonce")        // this job's
      .template Attr<bool>("missing_ok");     // else a missing one is an error
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

// Struct members: ", StructMember<type>("name")" per attribute of a list,
// after a first member written out (the macro takes no leading comma).
#define JAXCOMM_ATTR_MEMBER(type, name) , ::xla::ffi::StructMember<type>(#name)

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxcomm::AllReduceAttrs<jaxcomm::Site::kOpId>,
                                      StructMember<int64_t>("op_id")
                                          JAXCOMM_REDUCTION_ATTRS(JAXCOMM_ATTR_MEMBER)
                                              JAXCOMM_CHUNK_MASK_ATTRS(JAXCOMM_ATTR_MEMBER));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxcomm::AllReduceAttrs<jaxcomm::Site::kGroups>,
                                      StructMember<Span<const int64_t>>("groups")
                                          JAXCOMM_REDUCTION_ATTRS(JAXCOMM_ATTR_MEMBER)
                                              JAXCOMM_CHUNK_MASK_ATTRS(JAXCOMM_ATTR_MEMBER));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxcomm::ReductionAtOpId,
                                      StructMember<int64_t>("op_id")
                                          JAXCOMM_REDUCTION_ATTRS(JAXCOMM_ATTR_MEMBER));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxcomm::StartAttrs,
                                      StructMember<int64_t>("op_id")
                                          JAXCOMM_REDUCTION_ATTRS(JAXCOMM_ATTR_MEMBER),
                                      StructMember<int32_t>("nonce"),
                                      StructMember<int64_t>("chunk_size"));
