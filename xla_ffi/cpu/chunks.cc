// chunk_l1 and chunk_residual for the CPU FFI backend: chunk_sparse's two
// passes over its flat pool after the exchange, each reading only the
// chunks it needs.
//
// The exchanged pool holds the average on the selected chunks and zeros on
// the others; the local pool (gradient + residual) is only read where it was
// not sent. XLA's fused code for the same (a reduction over both pools, then
// a select between the old residual and the new one) reads every element of
// every operand: five passes over the pool where these calls make about
// three (the norms one, the residual's read of the unsent chunks and its
// write of the pool).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/chunk_layout.h"
#include "common/ffi_contract.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {
namespace {

namespace ffi = xla::ffi;

// The chunks of a pool of `n` elements (common/chunk_layout.h).
struct Chunks {
  size_t n, size, count;
  size_t Begin(size_t c) const { return c * size; }
  size_t End(size_t c) const { return Begin(c) + ChunkLength(c, n, size); }
};

ffi::Error CheckChunks(const char* op, size_t n, int64_t chunk_size, size_t nchunks,
                       Chunks* chunks) {
  int64_t count = 0;
  if (auto err = CheckChunkMask(op, n, chunk_size, nchunks, &count); !err.success()) return err;
  *chunks = {n, static_cast<size_t>(chunk_size), static_cast<size_t>(count)};
  return ffi::Error::Success();
}

// Sums in sixteen independent lanes of T (as XLA's float32 reduction, which
// it replaces): one chain of dependent adds would run at the adder's
// latency, several times below memory speed.
template <typename T>
float AbsSum(const T* x, size_t begin, size_t end) {
  constexpr size_t kLanes = 16;
  T lane[kLanes] = {};
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) lane[j] += std::fabs(x[i + j]);
  }
  T sum = 0;
  for (; i < end; ++i) sum += std::fabs(x[i]);
  for (T v : lane) sum += v;
  return static_cast<float>(sum);
}

template <typename T>
void L1(const Chunks& chunks, const bool* mask, const void* local, const void* exchanged,
        float* norms) {
  const T* loc = static_cast<const T*>(local);
  const T* ex = static_cast<const T*>(exchanged);
  for (size_t c = 0; c < chunks.count; ++c) {
    norms[c] = AbsSum(mask[c] ? ex : loc, chunks.Begin(c), chunks.End(c));
  }
}

ffi::Error ChunkL1Impl(ffi::AnyBuffer local, ffi::AnyBuffer exchanged, ffi::Buffer<ffi::PRED> mask,
                       ffi::Result<ffi::Buffer<ffi::F32>> norms, int64_t chunk_size) {
  constexpr const char* kOp = "chunk_l1";
  Chunks chunks;
  if (auto err = CheckChunks(kOp, local.element_count(), chunk_size, mask.element_count(), &chunks);
      !err.success()) {
    return err;
  }
  if (exchanged.element_type() != local.element_type() ||
      exchanged.element_count() != local.element_count() ||
      norms->element_count() != chunks.count) {
    return Invalid(kOp, "exchanged must be shaped like local, and the norms like the mask");
  }
  switch (local.element_type()) {
    case ffi::F32:
      L1<float>(chunks, mask.typed_data(), local.untyped_data(), exchanged.untyped_data(),
                norms->typed_data());
      return ffi::Error::Success();
    case ffi::F64:
      L1<double>(chunks, mask.typed_data(), local.untyped_data(), exchanged.untyped_data(),
                 norms->typed_data());
      return ffi::Error::Success();
    default:
      return Invalid(kOp, "float32 or float64 only");
  }
}

template <typename T>
void Residual(const Chunks& chunks, const bool* mask, const void* local, double decay, void* out) {
  const T* loc = static_cast<const T*>(local);
  T* res = static_cast<T*>(out);
  const T factor = static_cast<T>(decay);  // as XLA multiplies: in T
  for (size_t c = 0; c < chunks.count; ++c) {
    const size_t begin = chunks.Begin(c), end = chunks.End(c);
    if (mask[c]) {
      std::memset(res + begin, 0, (end - begin) * sizeof(T));
      continue;
    }
    for (size_t i = begin; i < end; ++i) res[i] = factor * loc[i];
  }
}

ffi::Error ChunkResidualImpl(ffi::AnyBuffer local, ffi::Buffer<ffi::PRED> mask,
                             ffi::Buffer<ffi::PRED> skip, ffi::AnyBuffer old,
                             ffi::Result<ffi::AnyBuffer> out, int64_t chunk_size, double decay) {
  constexpr const char* kOp = "chunk_residual";
  Chunks chunks;
  if (auto err = CheckChunks(kOp, local.element_count(), chunk_size, mask.element_count(), &chunks);
      !err.success()) {
    return err;
  }
  if (old.element_type() != local.element_type() || out->element_type() != local.element_type() ||
      old.element_count() != local.element_count() ||
      out->element_count() != local.element_count() || skip.element_count() != 1) {
    return Invalid(kOp, "old and the result must be shaped like local, and skip must be one flag");
  }
  if (skip.typed_data()[0]) {                         // a skipped step keeps the residual it had
    if (out->untyped_data() != old.untyped_data()) {  // XLA did not alias them after all
      std::memcpy(out->untyped_data(), old.untyped_data(), old.size_bytes());
    }
    return ffi::Error::Success();
  }
  switch (local.element_type()) {
    case ffi::F32:
      Residual<float>(chunks, mask.typed_data(), local.untyped_data(), decay, out->untyped_data());
      return ffi::Error::Success();
    case ffi::F64:
      Residual<double>(chunks, mask.typed_data(), local.untyped_data(), decay, out->untyped_data());
      return ffi::Error::Success();
    default:
      return Invalid(kOp, "float32 or float64 only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkL1Cpu, ChunkL1Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // local: gradient + residual
                                  .Arg<ffi::AnyBuffer>()          // exchanged: averaged chunks
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask: the chunks sent
                                  .Ret<ffi::Buffer<ffi::F32>>()   // norms: one per chunk
                                  .Attr<int64_t>("chunk_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkResidualCpu, ChunkResidualImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // local: gradient + residual
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask: the chunks sent
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // skip: the step is skipped
                                  .Arg<ffi::AnyBuffer>()          // old: the residual it had
                                  .Ret<ffi::AnyBuffer>()          // the next residual
                                  .Attr<int64_t>("chunk_size")
                                  .Attr<double>("decay"));

}  // namespace jaxcomm::cpu
