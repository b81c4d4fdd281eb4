// A tiny status type for the algorithm layer, which must not depend on XLA:
// the same schedules run under the CPU FFI handlers, the CUDA ones and the
// pybind11 test harness. Handlers turn a failed Status into an ffi::Error.
#pragma once

#include <string>
#include <utility>

namespace jaxcomm {

enum class Code { kOk, kInvalidArgument, kDeadlineExceeded, kAborted, kInternal };

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

#define JAXCOMM_RETURN_IF_ERROR(expr) \
  do {                                \
    ::jaxcomm::Status _st = (expr);   \
    if (!_st.ok()) return _st;        \
  } while (0)

}  // namespace jaxcomm
