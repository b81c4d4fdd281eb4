// after for the CPU FFI backend: its first operand, once the others exist.
//
// XLA's CPU pipeline drops optimization barriers, and its scheduler puts a
// value's readers as early as their operands allow; buffer assignment then
// lends the memory they free to later work, which makes that work wait for
// the readers. A double-buffered collective's readers belong after the
// step's backward pass: this call holds its result until the step's gradient
// exists, without reading it. The result aliases the first operand.
#include <cstring>

#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

namespace ffi = xla::ffi;

ffi::Error AfterImpl(ffi::AnyBuffer x, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> y) {
  if (x.size_bytes() != y->size_bytes()) {
    return ffi::Error::InvalidArgument("jaxcomm_after: the result must be shaped like x");
  }
  if (y->untyped_data() != x.untyped_data()) {  // XLA did not alias them after all
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AfterCpu, AfterImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()    // x: what comes back
                                  .RemainingArgs()          // waited for, never read
                                  .Ret<ffi::AnyBuffer>());  // y: x, in x's buffer

}  // namespace jaxcomm::cpu
