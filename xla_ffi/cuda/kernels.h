// The CUDA side of the Kernels interface, plus the chunk kernels the
// transforms need on GPU (masked pack/unpack, per-chunk L1 norms). Every
// launch goes on the stream XLA handed the handler; nothing synchronizes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/kernels.h"
#include "common/status.h"
#include "cuda/runtime.h"

namespace jaxcomm::cuda {

// Kernels cannot return errors through the Kernels interface (the CPU loops
// never fail), so the first failed launch is kept and read with status().
class CudaKernels final : public Kernels {
 public:
  explicit CudaKernels(cudaStream_t stream) : stream_(stream) {}
  void Convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n,
               double scale) override;
  void Accumulate(void* acc, DType acc_type, const void* src, DType src_type, size_t n) override;
  void Saturate(void* acc, DType acc_type, DType wire, size_t n) override;
  void Zero(void* dst, size_t bytes) override;
  Status status() const { return status_; }

 private:
  void Check(cudaError_t err, const char* what);
  cudaStream_t stream_;
  Status status_;
};

// offsets[c] = number of selected chunks before chunk c, for c in
// [0, nchunks]; offsets[nchunks] is the total. One small block: masks have
// one entry per chunk (32K elements), so nchunks is small.
Status LaunchChunkOffsets(cudaStream_t stream, const bool* mask, int64_t nchunks, int32_t* offsets);

// packed[offsets[c] * chunk_size + j] = x[c * chunk_size + j] for selected c
// with offsets[c] < slots (the packed buffer holds `slots` chunks; later
// selected ones are left out). Only the last chunk can be short, and it is
// packed last, so the packed data is dense.
Status LaunchPackChunks(cudaStream_t stream, const void* x, size_t n, size_t elem_bytes,
                        const bool* mask, const int32_t* offsets, int64_t chunk_size, int64_t slots,
                        void* packed);

// packed[k] = 0 for k in [packed length, size), the packed length read from
// offsets on the device: no host round trip.
Status LaunchZeroPackedTail(cudaStream_t stream, const bool* mask, const int32_t* offsets,
                            int64_t nchunks, int64_t chunk_size, size_t n, size_t size,
                            size_t elem_bytes, void* packed);

// The inverse of LaunchPackChunks: selected chunks of y with offsets[c] <
// slots come from packed; the others are left as they are.
Status LaunchUnpackChunks(cudaStream_t stream, const void* packed, size_t n, size_t elem_bytes,
                          const bool* mask, const int32_t* offsets, int64_t chunk_size,
                          int64_t slots, void* y);

// norms[c] = sum_j |x[c * chunk_size + j]|, accumulated in float32 (float64
// for float64 input) and stored as float32.
Status LaunchChunkL1Norms(cudaStream_t stream, const void* x, DType type, size_t n,
                          int64_t chunk_size, float* norms);

}  // namespace jaxcomm::cuda
