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

// The all-to-all schedule's two local passes (cuda/alltoall.h). Each does in
// one pass what CudaKernels' Convert, Saturate and Accumulate would do in
// several, with the same rounding, so the host stand-ins are those calls.
//
// wire[i] = wire_type(clamp(acc(in[i]) * prescale)), acc the accumulator type
// of `input`; the clamp to the wire's largest finite value only if `saturate`.
Status LaunchEncode(cudaStream_t stream, const void* in, DType input, void* wire, DType wire_type,
                    size_t n, double prescale, bool saturate);

// For i < count: out[i] = wire(acc(postscale * clamp(s))), where s is the sum
// over q = 0..nshards-1, in that order and in the accumulator type, of
// shards[q * stride + i], reading `own` instead for q == rank (the clamp
// only if `saturate`). For count <= i < padded: out[i] = 0. `out` may be
// `own`: each element is read before it is written.
Status LaunchReduceShards(cudaStream_t stream, const void* shards, size_t stride, const void* own,
                          int rank, int nshards, DType wire, DType acc, size_t count, size_t padded,
                          double postscale, bool saturate, void* out);

// norms[c] = sum_j |x[c * chunk_size + j]|, accumulated in float32 (float64
// for float64 input) and stored as float32.
Status LaunchChunkL1Norms(cudaStream_t stream, const void* x, DType type, size_t n,
                          int64_t chunk_size, float* norms);

}  // namespace jaxcomm::cuda
