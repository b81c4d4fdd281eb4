// pool for the CPU FFI backend: flat parts written one after another into
// one buffer, each element plus the same element of an addend, or copied as
// they are where the addend is empty (a bucket built without a
// concatenate, and without a buffer of zeros to add).
//
// chunk_sparse reduces its gradient as one flat pool plus its residual.
// XLA's CPU code for that (a zeroed buffer updated part by part, or a
// concatenate, then the add) runs well below memory bandwidth, and which is
// slower depends on the parts' sizes (bench/README.md, overhead.py). This
// call reads every part and the addend once and writes the pool once.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

namespace ffi = xla::ffi;

template <typename T>
void AddInto(const T* part, const T* addend, T* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = part[i] + addend[i];
}

template <typename T>
ffi::Error Write(ffi::AnyBuffer addend, ffi::RemainingArgs parts, void* out, size_t size) {
  const T* add = addend.element_count() ? static_cast<const T*>(addend.untyped_data()) : nullptr;
  T* pool = static_cast<T*>(out);
  size_t at = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    auto part = parts.get<ffi::AnyBuffer>(i);
    if (part.has_error()) return part.error();
    if (part->element_type() != addend.element_type()) {
      return ffi::Error::InvalidArgument("jaxcomm_pool: part " + std::to_string(i) +
                                         " has another dtype than the addend");
    }
    const size_t n = part->element_count();
    if (at + n > size) {
      return ffi::Error::InvalidArgument(
          "jaxcomm_pool: the parts hold more elements than the pool");
    }
    const T* from = static_cast<const T*>(part->untyped_data());
    if (add) {
      AddInto(from, add + at, pool + at, n);
    } else if (n) {
      std::memcpy(pool + at, from, n * sizeof(T));
    }
    at += n;
  }
  if (at != size) {
    return ffi::Error::InvalidArgument("jaxcomm_pool: the parts hold fewer elements than the pool");
  }
  return ffi::Error::Success();
}

ffi::Error PoolImpl(ffi::AnyBuffer addend, ffi::RemainingArgs parts,
                    ffi::Result<ffi::AnyBuffer> pool) {
  const size_t size = pool->element_count();
  if (pool->element_type() != addend.element_type() ||
      (addend.element_count() != 0 && addend.element_count() != size)) {
    return ffi::Error::InvalidArgument(
        "jaxcomm_pool: the result must be shaped like the addend, or the addend empty");
  }
  switch (addend.element_type()) {
    case ffi::F32:
      return Write<float>(addend, parts, pool->untyped_data(), size);
    case ffi::F64:
      return Write<double>(addend, parts, pool->untyped_data(), size);
    default:
      return ffi::Error::InvalidArgument("jaxcomm_pool: float32 or float64 only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PoolCpu, PoolImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()    // addend: flat, or empty
                                  .RemainingArgs()          // the parts, in pool order
                                  .Ret<ffi::AnyBuffer>());  // pool: parts + addend

}  // namespace jaxcomm::cpu
