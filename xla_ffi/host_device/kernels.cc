// CudaKernels and the chunk kernels on the host device: plain loops, run in
// order on the stream like the CUDA kernels they stand for (same rounding:
// kernels.cu follows cpu/cpu_kernels.cc bit for bit).
#include "cuda/kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/chunk_layout.h"
#include "cpu/cpu_kernels.h"

namespace jaxcomm::cuda {

void CudaKernels::Convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n,
                          double scale) {
  host_device::Enqueue(
      stream_, [=] { cpu::CpuKernels::Get().Convert(dst, dst_type, src, src_type, n, scale); });
}

void CudaKernels::Accumulate(void* acc, DType acc_type, const void* src, DType src_type, size_t n) {
  host_device::Enqueue(stream_,
                       [=] { cpu::CpuKernels::Get().Accumulate(acc, acc_type, src, src_type, n); });
}

void CudaKernels::Saturate(void* acc, DType acc_type, DType wire, size_t n) {
  host_device::Enqueue(stream_, [=] { cpu::CpuKernels::Get().Saturate(acc, acc_type, wire, n); });
}

void CudaKernels::Zero(void* dst, size_t bytes) {
  host_device::Enqueue(stream_, [=] { cpu::CpuKernels::Get().Zero(dst, bytes); });
}

}  // namespace jaxcomm::cuda

namespace jaxcomm::cuda {

// The chunk kernels the allreduce handler launches for a mask.
Status LaunchChunkOffsets(cudaStream_t stream, const bool* mask, int64_t nchunks,
                          int32_t* offsets) {
  host_device::Enqueue(stream, [=] {
    int32_t at = 0;
    for (int64_t c = 0; c < nchunks; ++c) {
      offsets[c] = at;
      at += mask[c] ? 1 : 0;
    }
    offsets[nchunks] = at;
  });
  return Status::Ok();
}

Status LaunchPackChunks(cudaStream_t stream, const void* x, size_t n, size_t elem_bytes,
                        const bool* mask, const int32_t* offsets, int64_t chunk_size, int64_t slots,
                        void* packed) {
  host_device::Enqueue(stream, [=] {
    const size_t nchunks = ChunkCount(n, chunk_size);
    for (size_t c = 0; c < nchunks; ++c) {
      if (!mask[c] || offsets[c] >= slots) continue;
      const size_t begin = c * chunk_size, len = ChunkLength(c, n, chunk_size);
      std::memcpy(static_cast<char*>(packed) + offsets[c] * chunk_size * elem_bytes,
                  static_cast<const char*>(x) + begin * elem_bytes, len * elem_bytes);
    }
  });
  return Status::Ok();
}

Status LaunchZeroPackedTail(cudaStream_t stream, const bool* mask, const int32_t* offsets,
                            int64_t nchunks, int64_t chunk_size, size_t n, size_t size,
                            size_t elem_bytes, void* packed) {
  host_device::Enqueue(stream, [=] {
    // A short last chunk that is selected ends the packed data early.
    const bool short_selected = nchunks > 0 && mask[nchunks - 1];
    const size_t short_by =
        short_selected ? chunk_size - ChunkLength(nchunks - 1, n, chunk_size) : 0;
    const size_t end = static_cast<size_t>(offsets[nchunks]) * chunk_size - short_by;
    if (end < size) {
      std::memset(static_cast<char*>(packed) + end * elem_bytes, 0, (size - end) * elem_bytes);
    }
  });
  return Status::Ok();
}

Status LaunchUnpackChunks(cudaStream_t stream, const void* packed, size_t n, size_t elem_bytes,
                          const bool* mask, const int32_t* offsets, int64_t chunk_size,
                          int64_t slots, void* y) {
  host_device::Enqueue(stream, [=] {
    const size_t nchunks = ChunkCount(n, chunk_size);
    for (size_t c = 0; c < nchunks; ++c) {
      if (!mask[c] || offsets[c] >= slots) continue;
      const size_t begin = c * chunk_size, len = ChunkLength(c, n, chunk_size);
      std::memcpy(static_cast<char*>(y) + begin * elem_bytes,
                  static_cast<const char*>(packed) + offsets[c] * chunk_size * elem_bytes,
                  len * elem_bytes);
    }
  });
  return Status::Ok();
}

}  // namespace jaxcomm::cuda

namespace jaxcomm::cuda {

// The all-to-all schedule's passes, as the CudaKernels calls they fuse.
Status LaunchEncode(cudaStream_t stream, const void* in, DType input, void* wire, DType wire_type,
                    size_t n, double prescale, bool saturate) {
  if (n == 0) return Status::Ok();
  host_device::Enqueue(stream, [=] {
    cpu::CpuKernels& k = cpu::CpuKernels::Get();
    const DType acc = AccumulatorFor(input);
    std::vector<char> a(n * SizeOf(acc));
    k.Convert(a.data(), acc, in, input, n, prescale);
    if (saturate) k.Saturate(a.data(), acc, wire_type, n);
    k.Convert(wire, wire_type, a.data(), acc, n, 1.0);
  });
  return Status::Ok();
}

Status LaunchReduceShards(cudaStream_t stream, const void* shards, size_t stride, const void* own,
                          int rank, int nshards, DType wire, DType acc, size_t count, size_t padded,
                          double postscale, bool saturate, void* out) {
  host_device::Enqueue(stream, [=] {
    cpu::CpuKernels& k = cpu::CpuKernels::Get();
    const size_t ws = SizeOf(wire);
    auto shard = [&](int q) {
      return q == rank ? own : static_cast<const char*>(shards) + q * stride * ws;
    };
    if (count > 0) {  // a short group's last ranks may own no elements
      std::vector<char> s(count * SizeOf(acc));
      k.Convert(s.data(), acc, shard(0), wire, count, 1.0);
      for (int q = 1; q < nshards; ++q) k.Accumulate(s.data(), acc, shard(q), wire, count);
      if (saturate) k.Saturate(s.data(), acc, wire, count);
      k.Convert(out, wire, s.data(), acc, count, postscale);
    }
    k.Zero(static_cast<char*>(out) + count * ws, (padded - count) * ws);
  });
  return Status::Ok();
}

}  // namespace jaxcomm::cuda
