// Small adapters between XLA FFI types and the algorithm layer.
#pragma once

#include <optional>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {

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

// Decodes the input dtype and the wire dtype code, or says what is wrong.
inline ffi::Error DecodeTypes(const std::string& op, ffi::DataType input, int32_t wire_code,
                              DType* in, DType* wire) {
  auto t = FromFfi(input);
  if (!t) {
    return ffi::Error::InvalidArgument("jaxcomm " + op +
                                       ": input dtype must be float32, float16, bfloat16 or "
                                       "float64");
  }
  *in = *t;
  if (wire_code < 0) {
    *wire = *t;
  } else if (IsValidDType(wire_code)) {
    *wire = static_cast<DType>(wire_code);
  } else {
    return ffi::Error::InvalidArgument("jaxcomm " + op + ": unknown wire dtype code " +
                                       std::to_string(wire_code));
  }
  return ffi::Error::Success();
}

}  // namespace jaxcomm::cpu
