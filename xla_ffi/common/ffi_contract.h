// The contract every platform's collective handlers share with XLA and with
// jaxcomm/collectives/_ffi_calls.py: dtype decoding, Status -> ffi::Error, and
// the argument checks (one message per mistake, whichever platform sees it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "common/algorithm_code.h"
#include "common/chunk_layout.h"
#include "common/codes.h"
#include "common/dtype.h"
#include "common/ffi_bindings.h"
#include "common/reduce_spec.h"
#include "common/status.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

inline std::optional<DType> FromFfi(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return DType::kF32;
    case ffi::DataType::F16:
      return DType::kF16;
    case ffi::DataType::BF16:
      return DType::kBF16;
    case ffi::DataType::F64:
      return DType::kF64;
    default:
      return std::nullopt;
  }
}

inline ffi::Error ToError(const Status& st) {
  switch (st.code()) {
    case Code::kOk:
      return ffi::Error::Success();
    case Code::kInvalidArgument:
      return ffi::Error::InvalidArgument(st.message());
    case Code::kDeadlineExceeded:
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, st.message());
    case Code::kAborted:
      return ffi::Error(ffi::ErrorCode::kAborted, st.message());
    case Code::kInternal:
      return ffi::Error::Internal(st.message());
  }
  return ffi::Error::Internal(st.message());
}

inline ffi::Error Invalid(const std::string& op, const std::string& what) {
  return ffi::Error::InvalidArgument("jaxcomm " + op + ": " + what);
}

// Decodes an input's dtype, or says what is wrong.
inline ffi::Error DecodeInput(const std::string& op, ffi::DataType input, DType* in) {
  auto t = FromFfi(input);
  if (!t) return Invalid(op, "input dtype must be float32, float16, bfloat16 or float64");
  *in = *t;
  return ffi::Error::Success();
}

// Decodes the input dtype and the wire dtype code (-1: the input's), or says
// what is wrong.
inline ffi::Error DecodeTypes(const std::string& op, ffi::DataType input, int32_t wire_code,
                              DType* in, DType* wire) {
  if (auto err = DecodeInput(op, input, in); !err.success()) return err;
  if (wire_code < 0) {
    *wire = *in;
  } else if (IsValidDType(wire_code)) {
    *wire = static_cast<DType>(wire_code);
  } else {
    return Invalid(op, "unknown wire dtype code " + std::to_string(wire_code));
  }
  return ffi::Error::Success();
}

// The [group, rank] operand every collective handler takes.
inline ffi::Error CheckCoords(const std::string& op, const ffi::Buffer<ffi::S32>& coords) {
  if (coords.element_count() >= 2) return ffi::Error::Success();
  return Invalid(op, "coords must hold [group, rank]");
}

// What every reducing collective decodes first: the input and wire types
// into `spec` with its scales, and the coords operand.
inline ffi::Error DecodeReduction(const std::string& op, const ffi::AnyBuffer& x,
                                  const ffi::Buffer<ffi::S32>& coords, int32_t wire_dtype,
                                  double prescale, double postscale, ReduceSpec* spec) {
  if (auto err = DecodeTypes(op, x.element_type(), wire_dtype, &spec->input, &spec->wire);
      !err.success()) {
    return err;
  }
  spec->prescale = prescale;
  spec->postscale = postscale;
  return CheckCoords(op, coords);
}

// What allreduce, allreduce_parts and allreduce_start decode first: the
// above from their reduction attributes, and the algorithm code.
inline ffi::Error DecodeReduction(const std::string& op, const ffi::AnyBuffer& x,
                                  const ffi::Buffer<ffi::S32>& coords, const ReductionAttrs& r,
                                  ReduceSpec* spec) {
  if (auto err = DecodeReduction(op, x, coords, r.wire_dtype, r.prescale, r.postscale, spec);
      !err.success()) {
    return err;
  }
  if (!IsValidAlgorithm(r.algorithm)) {
    return Invalid(op, "unknown algorithm code " + std::to_string(r.algorithm));
  }
  return ffi::Error::Success();
}

// allreduce_done's error for a handle this job has not in flight, `h` as
// read ([nonce, op_id, sequence]), on `device`, with this job's `nonce`.
inline ffi::Error MissingHandle(int32_t device, const int32_t* h, int32_t nonce) {
  return Invalid(
      "allreduce_done",
      "no allreduce in flight on device " + std::to_string(device) + " with handle [" +
          std::to_string(h[0]) + ", " + std::to_string(h[1]) + ", " + std::to_string(h[2]) +
          "] (this job's handles begin " + std::to_string(nonce) +
          "): each handle is finished once, in the job that started it (a handle restored "
          "from another job's state is not this job's: with missing_ok the call "
          "reports it, and the caller reduces what it kept)");
}

// The chunks of `elements` (common/chunk_layout.h): sets `nchunks`, or says
// why `chunk_size` cannot cut them.
inline ffi::Error CountChunks(const std::string& op, size_t elements, int64_t chunk_size,
                              int64_t* nchunks) {
  if (chunk_size <= 0) return Invalid(op, "chunk_size <= 0");
  *nchunks = static_cast<int64_t>(ChunkCount(elements, static_cast<size_t>(chunk_size)));
  return ffi::Error::Success();
}

// A chunk mask: one flag per chunk of `elements`. Sets `nchunks`, or says
// what is wrong.
inline ffi::Error CheckChunkMask(const std::string& op, size_t elements, int64_t chunk_size,
                                 size_t mask_entries, int64_t* nchunks) {
  if (auto err = CountChunks(op, elements, chunk_size, nchunks); !err.success()) return err;
  if (static_cast<int64_t>(mask_entries) != *nchunks) {
    return Invalid(op, "chunk mask has " + std::to_string(mask_entries) +
                           " entries but the input has " + std::to_string(*nchunks) + " chunks");
  }
  return ffi::Error::Success();
}

// What an allreduce call must satisfy before any rank communicates. Fills
// `spec`'s types and scales, `nchunks` (0 without a mask: every element) and
// `slots`: how many selected chunks are packed, the first
// `chunks.max_chunks` of them (all for 0); chunks selected beyond that are
// not reduced. `chunks.unselected` (an Unselected code) says what the other
// chunks of the result hold: the local input or zeros.
inline ffi::Error CheckAllReduce(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& coords,
                                 const ffi::Buffer<ffi::PRED>& mask, const ffi::AnyBuffer& y,
                                 const ReductionAttrs& reduction, const ChunkMaskAttrs& chunks,
                                 ReduceSpec* spec, int64_t* nchunks, int64_t* slots) {
  const std::string op = "allreduce";
  if (auto err = DecodeReduction(op, x, coords, reduction, spec); !err.success()) return err;
  if (y.element_type() != x.element_type() || y.element_count() != x.element_count()) {
    return Invalid(op, "output must have x's dtype and size");
  }
  if (!IsNamedCode(kUnselectedNames, chunks.unselected)) {
    return Invalid(op, "unknown unselected code " + std::to_string(chunks.unselected));
  }
  *nchunks = *slots = 0;
  if (mask.element_count() == 0) return ffi::Error::Success();
  if (auto err =
          CheckChunkMask(op, x.element_count(), chunks.chunk_size, mask.element_count(), nchunks);
      !err.success()) {
    return err;
  }
  if (chunks.max_chunks < 0) return Invalid(op, "max_chunks < 0");
  *slots = chunks.max_chunks == 0 ? *nchunks : std::min(chunks.max_chunks, *nchunks);
  return ffi::Error::Success();
}

// reduce_scatter: rank r keeps elements [r*S, (r+1)*S) of the input
// zero-padded to a multiple of nranks.
inline ffi::Error CheckReduceScatter(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& coords,
                                     const ffi::AnyBuffer& y, int32_t nranks, int32_t wire_dtype,
                                     double prescale, double postscale, ReduceSpec* spec) {
  const std::string op = "reduce_scatter";
  if (auto err = DecodeReduction(op, x, coords, wire_dtype, prescale, postscale, spec);
      !err.success()) {
    return err;
  }
  const size_t n = x.element_count();
  const size_t shard = nranks > 0 ? (n + nranks - 1) / nranks : 0;
  if (y.element_count() != shard) {
    return Invalid(op, "output must hold " + std::to_string(shard) + " elements");
  }
  return ffi::Error::Success();
}

// all_gather: every rank's m elements, in rank order.
inline ffi::Error CheckAllGather(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& coords,
                                 const ffi::AnyBuffer& y, int32_t nranks, int32_t wire_dtype,
                                 DType* input, DType* wire) {
  const std::string op = "all_gather";
  if (auto err = DecodeTypes(op, x.element_type(), wire_dtype, input, wire); !err.success()) {
    return err;
  }
  if (auto err = CheckCoords(op, coords); !err.success()) return err;
  const size_t m = x.element_count();
  if (nranks < 1 || y.element_count() != m * static_cast<size_t>(nranks)) {
    return Invalid(op, "output must hold nranks * " + std::to_string(m) + " elements");
  }
  return ffi::Error::Success();
}

}  // namespace jaxcomm
