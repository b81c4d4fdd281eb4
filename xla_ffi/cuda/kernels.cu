// CUDA kernels behind CudaKernels and the chunk operations. Conversions round
// to nearest even like the CPU loops in cpu/cpu_kernels.cc, and widen to
// float64 only when one side is float64, so both backends give the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "common/chunk_layout.h"
#include "cuda/check.h"
#include "cuda/kernels.h"
#include "cuda/vector_plan.h"

namespace jaxcomm::cuda {
namespace {

template <DType T>
struct Elem;
template <>
struct Elem<DType::kF32> {
  using Storage = float;
  __device__ static float Load(Storage v) { return v; }
  __device__ static Storage Store(float v) { return v; }
};
template <>
struct Elem<DType::kF64> {
  using Storage = double;
  __device__ static double Load(Storage v) { return v; }
  __device__ static Storage Store(double v) { return v; }
};
template <>
struct Elem<DType::kF16> {
  using Storage = __half;
  __device__ static float Load(Storage v) { return __half2float(v); }
  __device__ static Storage Store(float v) { return __float2half_rn(v); }
};
template <>
struct Elem<DType::kBF16> {
  using Storage = __nv_bfloat16;
  __device__ static float Load(Storage v) { return __bfloat162float(v); }
  __device__ static Storage Store(float v) { return __float2bfloat16_rn(v); }
};

template <DType A, DType B>
using Wide = std::conditional_t<A == DType::kF64 || B == DType::kF64, double, float>;

unsigned Blocks(size_t n) { return static_cast<unsigned>(Tiles(n)); }

// One tile of kTile elements per block; consecutive threads touch
// consecutive elements so every load is coalesced.
template <typename Op>
__global__ void Elementwise(size_t n, Op op) {
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const size_t i = TileUnit(blockIdx.x, threadIdx.x, k);
    if (i < n) op(i);
  }
}

// N elements moved by one load or store (alignas makes it a vector access).
template <typename T, size_t N>
struct alignas(N * sizeof(T)) Vec {
  T e[N];
};

// out[i] = op.Apply(in[i]) in vectors of VecLen elements, as planned in
// vector_plan.h. A thread issues all its loads before any math, so kItems
// vectors (64 bytes on the wider side) are in flight per thread.
template <typename Op>
__global__ void __launch_bounds__(kThreads) VectorMap(MapPlan plan, Op op) {
  using In = typename Op::In;
  using Out = typename Op::Out;
  constexpr size_t kVec = VecLen(sizeof(In), sizeof(Out));
  const auto* in = reinterpret_cast<const Vec<In, kVec>*>(op.in + plan.head);
  auto* out = reinterpret_cast<Vec<Out, kVec>*>(op.out + plan.head);
  Vec<In, kVec> w[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const size_t v = TileUnit(blockIdx.x, threadIdx.x, k);
    if (v < plan.vecs) w[k] = in[v];
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const size_t v = TileUnit(blockIdx.x, threadIdx.x, k);
    if (v < plan.vecs) {
      Vec<Out, kVec> r;
#pragma unroll
      for (size_t e = 0; e < kVec; ++e) r.e[e] = op.Apply(w[k].e[e]);
      out[v] = r;
    }
  }
  if (DoesHeadElement(plan, blockIdx.x, threadIdx.x)) op(threadIdx.x);
  if (DoesTailElement(plan, blockIdx.x, threadIdx.x)) op(plan.tail + threadIdx.x);
}

// A one-input map (op.in, op.out, op.Apply) over n > 0 elements: vectors
// where in and out can be aligned together, the scalar kernel where not.
template <typename Op>
cudaError_t LaunchMap(cudaStream_t stream, size_t n, const Op& op) {
  const MapPlan plan = PlanMap(reinterpret_cast<uintptr_t>(op.in), sizeof(typename Op::In),
                               reinterpret_cast<uintptr_t>(op.out), sizeof(typename Op::Out), n);
  if (plan.vector) {
    VectorMap<<<static_cast<unsigned>(MapBlocks(plan)), kThreads, 0, stream>>>(plan, op);
  } else {
    Elementwise<<<Blocks(n), kThreads, 0, stream>>>(n, op);
  }
  return cudaGetLastError();
}

template <DType D, DType S>
struct ConvertOp {
  using In = typename Elem<S>::Storage;
  using Out = typename Elem<D>::Storage;
  Out* out;
  const In* in;
  Wide<D, S> scale;
  __device__ Out Apply(In x) const {
    return Elem<D>::Store(static_cast<Wide<D, S>>(Elem<S>::Load(x)) * scale);
  }
  __device__ void operator()(size_t i) const { out[i] = Apply(in[i]); }
};

template <DType A, DType S>
struct AccumulateOp {
  typename Elem<A>::Storage* acc;
  const typename Elem<S>::Storage* in;
  __device__ void operator()(size_t i) const {
    acc[i] += static_cast<Wide<A, S>>(Elem<S>::Load(in[i]));
  }
};

template <typename T>
struct SaturateOp {
  T* acc;
  T hi;  // the wire type's largest finite value
  __device__ void operator()(size_t i) const {
    const T v = acc[i];
    if (isfinite(v)) acc[i] = v > hi ? hi : (v < -hi ? -hi : v);  // inf and NaN pass
  }
};

template <typename T>
cudaError_t SaturateTyped(cudaStream_t stream, void* acc, double max, size_t n) {
  if (max >= std::numeric_limits<T>::max()) return cudaSuccess;  // nothing in T exceeds the wire
  SaturateOp<T> op{static_cast<T*>(acc), static_cast<T>(max)};
  Elementwise<<<Blocks(n), kThreads, 0, stream>>>(n, op);
  return cudaGetLastError();
}

template <DType D, DType S>
cudaError_t ConvertTyped(cudaStream_t stream, void* dst, const void* src, size_t n, double scale) {
  if (D == S && scale == 1.0) {
    if (dst == src) return cudaSuccess;
    return cudaMemcpyAsync(dst, src, n * sizeof(typename Elem<D>::Storage),
                           cudaMemcpyDeviceToDevice, stream);
  }
  ConvertOp<D, S> op{static_cast<typename Elem<D>::Storage*>(dst),
                     static_cast<const typename Elem<S>::Storage*>(src),
                     static_cast<Wide<D, S>>(scale)};
  return LaunchMap(stream, n, op);
}

template <DType A, DType S>
cudaError_t AccumulateTyped(cudaStream_t stream, void* acc, const void* src, size_t n) {
  AccumulateOp<A, S> op{static_cast<typename Elem<A>::Storage*>(acc),
                        static_cast<const typename Elem<S>::Storage*>(src)};
  Elementwise<<<Blocks(n), kThreads, 0, stream>>>(n, op);
  return cudaGetLastError();
}

template <DType D>
cudaError_t ConvertTo(cudaStream_t stream, void* dst, const void* src, DType src_type, size_t n,
                      double scale) {
  switch (src_type) {
    case DType::kF32:
      return ConvertTyped<D, DType::kF32>(stream, dst, src, n, scale);
    case DType::kF16:
      return ConvertTyped<D, DType::kF16>(stream, dst, src, n, scale);
    case DType::kBF16:
      return ConvertTyped<D, DType::kBF16>(stream, dst, src, n, scale);
    case DType::kF64:
      return ConvertTyped<D, DType::kF64>(stream, dst, src, n, scale);
  }
  return cudaErrorInvalidValue;
}

template <DType A>
cudaError_t AccumulateInto(cudaStream_t stream, void* acc, const void* src, DType src_type,
                           size_t n) {
  switch (src_type) {
    case DType::kF32:
      return AccumulateTyped<A, DType::kF32>(stream, acc, src, n);
    case DType::kF16:
      return AccumulateTyped<A, DType::kF16>(stream, acc, src, n);
    case DType::kBF16:
      return AccumulateTyped<A, DType::kBF16>(stream, acc, src, n);
    case DType::kF64:
      return AccumulateTyped<A, DType::kF64>(stream, acc, src, n);
  }
  return cudaErrorInvalidValue;
}

// Exclusive scan of the mask in one block: each thread counts a contiguous
// slice, thread 0 scans the 1024 partial counts, each thread writes its slice.
// The launch bound caps registers at 64 a thread, so a block of 1024 always
// fits on an SM (without it, a register-hungry build fails to launch).
constexpr int kScanThreads = 1024;
__global__ void __launch_bounds__(kScanThreads)
    ChunkOffsetsKernel(const bool* mask, int64_t nchunks, int32_t* offsets) {
  __shared__ int32_t partial[kScanThreads + 1];
  const int64_t per = (nchunks + kScanThreads - 1) / kScanThreads;
  const int64_t begin = min(nchunks, per * threadIdx.x), end = min(nchunks, begin + per);
  int32_t count = 0;
  for (int64_t c = begin; c < end; ++c) count += mask[c] ? 1 : 0;
  partial[threadIdx.x + 1] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    partial[0] = 0;
    for (int t = 1; t <= kScanThreads; ++t) partial[t] += partial[t - 1];
    offsets[nchunks] = partial[kScanThreads];
  }
  __syncthreads();
  int32_t at = partial[threadIdx.x];
  for (int64_t c = begin; c < end; ++c) {
    offsets[c] = at;
    at += mask[c] ? 1 : 0;
  }
}

// Blocks walk chunks tile by tile, so the chunk index costs one division per
// block, and a block of an unselected chunk exits before touching memory.
// A unit is kVec elements: a 16-byte vector when the plan found every chunk
// aligned (vector_plan.h), else one element; a short last chunk's remainder
// goes singly. All of a thread's loads are issued before its stores.
template <typename T, size_t kVec, bool kPack>
__global__ void __launch_bounds__(kThreads)
    ChunkCopyKernel(const T* src, T* dst, size_t n, const bool* mask, const int32_t* offsets,
                    int64_t chunk_size, int64_t slots, int64_t tiles_per_chunk) {
  using Unit = Vec<T, kVec>;
  const int64_t c = blockIdx.x / tiles_per_chunk;
  if (!mask[c] || offsets[c] >= slots) return;
  const int64_t tile = blockIdx.x % tiles_per_chunk;
  const size_t chunk_begin = static_cast<size_t>(c) * chunk_size;
  const size_t packed_begin = static_cast<size_t>(offsets[c]) * chunk_size;
  const size_t chunk_len = ChunkLength(c, n, chunk_size);
  const T* from = src + (kPack ? chunk_begin : packed_begin);
  T* to = dst + (kPack ? packed_begin : chunk_begin);
  const size_t units = ChunkUnits(chunk_len, kVec);
  Unit w[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const size_t u = TileUnit(tile, threadIdx.x, k);
    if (u < units) w[k] = reinterpret_cast<const Unit*>(from)[u];
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const size_t u = TileUnit(tile, threadIdx.x, k);
    if (u < units) reinterpret_cast<Unit*>(to)[u] = w[k];
  }
  if (DoesRemainderElement(chunk_len, kVec, tile, threadIdx.x)) {
    const size_t j = units * kVec + threadIdx.x;
    to[j] = from[j];
  }
}

template <typename T, bool kPack>
void ChunkCopyTyped(cudaStream_t stream, const ChunkCopyPlan& plan, const void* src, void* dst,
                    size_t n, const bool* mask, const int32_t* offsets, int64_t chunk_size,
                    int64_t slots) {
  const unsigned grid = static_cast<unsigned>(plan.blocks);
  const T* from = static_cast<const T*>(src);
  T* to = static_cast<T*>(dst);
  if (plan.vec > 1) {
    ChunkCopyKernel<T, kVecBytes / sizeof(T), kPack><<<grid, kThreads, 0, stream>>>(
        from, to, n, mask, offsets, chunk_size, slots, plan.tiles_per_chunk);
  } else {
    ChunkCopyKernel<T, 1, kPack><<<grid, kThreads, 0, stream>>>(
        from, to, n, mask, offsets, chunk_size, slots, plan.tiles_per_chunk);
  }
}

template <bool kPack>
Status LaunchChunkCopy(cudaStream_t stream, const void* src, void* dst, size_t n, size_t elem_bytes,
                       const bool* mask, const int32_t* offsets, int64_t chunk_size,
                       int64_t slots) {
  if (n == 0) return Status::Ok();
  if (elem_bytes != 2 && elem_bytes != 4 && elem_bytes != 8) {
    return Status(Code::kInvalidArgument, "jaxcomm: element size must be 2, 4 or 8 bytes");
  }
  const ChunkCopyPlan plan =
      PlanChunkCopy(reinterpret_cast<uintptr_t>(src), reinterpret_cast<uintptr_t>(dst), n,
                    elem_bytes, chunk_size);
  if (plan.blocks > 0x7fffffffLL) {
    return Status(Code::kInvalidArgument, "jaxcomm: too many chunks for one launch");
  }
  switch (elem_bytes) {
    case 2:
      ChunkCopyTyped<uint16_t, kPack>(stream, plan, src, dst, n, mask, offsets, chunk_size, slots);
      break;
    case 4:
      ChunkCopyTyped<uint32_t, kPack>(stream, plan, src, dst, n, mask, offsets, chunk_size, slots);
      break;
    default:
      ChunkCopyTyped<uint64_t, kPack>(stream, plan, src, dst, n, mask, offsets, chunk_size, slots);
      break;
  }
  return FromCuda(cudaGetLastError(), kPack ? "pack chunks" : "unpack chunks");
}

// Whole elements (2, 4 or 8 bytes a store, every store aligned), from the
// packed length the device computed to `size`.
template <typename T>
__global__ void ZeroPackedTailKernel(const bool* mask, const int32_t* offsets, int64_t nchunks,
                                     int64_t chunk_size, size_t n, size_t size, T* packed) {
  // A short last chunk that is selected ends the packed data early.
  const size_t short_by = chunk_size - ChunkLength(nchunks - 1, n, chunk_size);
  const size_t packed_elems =
      static_cast<size_t>(offsets[nchunks]) * chunk_size - (mask[nchunks - 1] ? short_by : 0);
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  for (size_t i = packed_elems + static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x; i < size;
       i += stride) {
    packed[i] = T(0);
  }
}

template <typename T>
cudaError_t ZeroPackedTailTyped(cudaStream_t stream, const bool* mask, const int32_t* offsets,
                                int64_t nchunks, int64_t chunk_size, size_t n, size_t size,
                                void* packed) {
  // The tail's length is only known on the device: a grid sized for all
  // `size` elements (at most 1024 blocks, enough to fill the GPU) strides
  // over it.
  const unsigned grid =
      static_cast<unsigned>(std::min<size_t>((size + kThreads - 1) / kThreads, 1024));
  ZeroPackedTailKernel<T><<<grid, kThreads, 0, stream>>>(mask, offsets, nchunks, chunk_size, n,
                                                         size, static_cast<T*>(packed));
  return cudaGetLastError();
}

// Per-chunk L1 norms: one block per chunk, read in 16-byte vectors (8
// float16/bfloat16, 4 float32 or 2 float64 a load). Loading 16-bit elements
// one by one moved 64 bytes per warp instruction and kept too few bytes in
// flight to reach the memory's bandwidth. A chunk can start anywhere (its
// size is arbitrary), so the elements before its first 16-byte boundary and
// after its last one are read singly.
constexpr int kWarp = 32;

template <DType T, typename Acc>
__device__ Acc Abs(typename Elem<T>::Storage v) {
  return fabs(static_cast<Acc>(Elem<T>::Load(v)));
}

// The sum of |e| over one vector's elements, added pairwise.
template <DType T, typename Acc>
__device__ Acc AbsSum(const uint4& v) {
  using Storage = typename Elem<T>::Storage;
  constexpr int kVec = kVecBytes / sizeof(Storage);
  Storage e[kVec];
  memcpy(e, &v, kVecBytes);  // registers only: no memory is touched
  Acc s[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) s[i] = Abs<T, Acc>(e[i]);
#pragma unroll
  for (int width = kVec / 2; width > 0; width /= 2) {
#pragma unroll
    for (int i = 0; i < width; ++i) s[i] += s[i + width];
  }
  return s[0];
}

// The block's total, valid in thread 0: warp shuffles, then one warp adds
// the warps' sums.
template <typename Acc>
__device__ Acc BlockSum(Acc s) {
  __shared__ Acc warp_sums[kThreads / kWarp];
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) s += __shfl_down_sync(~0u, s, offset);
  if (threadIdx.x % kWarp == 0) warp_sums[threadIdx.x / kWarp] = s;
  __syncthreads();
  if (threadIdx.x >= kWarp) return s;
  s = threadIdx.x < kThreads / kWarp ? warp_sums[threadIdx.x] : Acc(0);
#pragma unroll
  for (int offset = kThreads / kWarp / 2; offset > 0; offset /= 2) {
    s += __shfl_down_sync(~0u, s, offset);
  }
  return s;
}

// Each thread keeps kItems vector loads in flight, each into its own partial
// sum (64 bytes a thread), so the block's few passes over its chunk are
// bounded by memory, not by load instructions.
template <DType T>
__global__ void __launch_bounds__(kThreads)
    ChunkL1NormsKernel(const typename Elem<T>::Storage* x, size_t n, int64_t chunk_size,
                       float* norms) {
  using Storage = typename Elem<T>::Storage;
  using Acc = std::conditional_t<T == DType::kF64, double, float>;
  constexpr size_t kVec = kVecBytes / sizeof(Storage);
  const size_t begin = static_cast<size_t>(blockIdx.x) * chunk_size;
  const size_t len = ChunkLength(blockIdx.x, n, chunk_size);
  const Storage* chunk = x + begin;
  const size_t past_boundary = (reinterpret_cast<uintptr_t>(chunk) / sizeof(Storage)) % kVec;
  const size_t head = min(len, (kVec - past_boundary) % kVec);  // elements before the vectors
  const size_t vecs = (len - head) / kVec;
  const size_t tail = head + vecs * kVec;  // the first element after them
  const uint4* body = reinterpret_cast<const uint4*>(chunk + head);
  Acc sum[kItems] = {};
  size_t v = threadIdx.x;
  for (; v + (kItems - 1) * kThreads < vecs; v += kItems * kThreads) {
    uint4 w[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) w[k] = __ldg(body + v + k * kThreads);
#pragma unroll
    for (int k = 0; k < kItems; ++k) sum[k] += AbsSum<T, Acc>(w[k]);
  }
  for (; v < vecs; v += kThreads) sum[0] += AbsSum<T, Acc>(__ldg(body + v));
  // Head and tail hold fewer than kVec elements each: one a thread.
  if (threadIdx.x < head) sum[1] += Abs<T, Acc>(chunk[threadIdx.x]);
  if (threadIdx.x < len - tail) sum[2] += Abs<T, Acc>(chunk[tail + threadIdx.x]);
  const Acc total = BlockSum<Acc>((sum[0] + sum[1]) + (sum[2] + sum[3]));
  if (threadIdx.x == 0) norms[blockIdx.x] = static_cast<float>(total);
}

// The all-to-all schedule's encode: Convert to the accumulator with the
// prescale, Saturate, Convert to the wire, per element.
template <DType I, DType W>
struct EncodeOp {
  static constexpr DType A = I == DType::kF64 ? DType::kF64 : DType::kF32;  // AccumulatorFor
  using AccT = typename Elem<A>::Storage;
  using In = typename Elem<I>::Storage;
  using Out = typename Elem<W>::Storage;
  const In* in;
  Out* out;
  Wide<A, I> scale;
  AccT hi;  // the wire's largest finite value
  bool saturate;
  __device__ Out Apply(In x) const {
    AccT a = Elem<A>::Store(static_cast<Wide<A, I>>(Elem<I>::Load(x)) * scale);
    if (saturate && isfinite(a)) a = a > hi ? hi : (a < -hi ? -hi : a);  // inf and NaN pass
    return Elem<W>::Store(static_cast<Wide<W, A>>(Elem<A>::Load(a)));
  }
  __device__ void operator()(size_t i) const { out[i] = Apply(in[i]); }
};

template <DType I, DType W>
cudaError_t EncodeTyped(cudaStream_t stream, const void* in, void* out, size_t n, double prescale,
                        bool saturate) {
  using Op = EncodeOp<I, W>;
  Op op{static_cast<const typename Elem<I>::Storage*>(in),
        static_cast<typename Elem<W>::Storage*>(out), static_cast<Wide<Op::A, I>>(prescale),
        static_cast<typename Op::AccT>(
            std::min<double>(MaxFinite(W), std::numeric_limits<typename Op::AccT>::max())),
        saturate};
  return LaunchMap(stream, n, op);
}

template <DType I>
cudaError_t EncodeFrom(cudaStream_t stream, const void* in, void* out, DType wire, size_t n,
                       double prescale, bool saturate) {
  switch (wire) {
    case DType::kF32:
      return EncodeTyped<I, DType::kF32>(stream, in, out, n, prescale, saturate);
    case DType::kF16:
      return EncodeTyped<I, DType::kF16>(stream, in, out, n, prescale, saturate);
    case DType::kBF16:
      return EncodeTyped<I, DType::kBF16>(stream, in, out, n, prescale, saturate);
    case DType::kF64:
      return EncodeTyped<I, DType::kF64>(stream, in, out, n, prescale, saturate);
  }
  return cudaErrorInvalidValue;
}

// The all-to-all schedule's reduce: the shards added in rank order in the
// accumulator type (a 16-bit wire is never added in 16 bits), clamped, then
// Convert to the wire with the postscale, per element. Reads N shards and
// writes one, once each.
template <DType W, DType A>
struct ReduceShardsOp {
  using WireT = typename Elem<W>::Storage;
  using AccT = typename Elem<A>::Storage;
  const WireT* shards;
  size_t stride;
  const WireT* own;
  int rank, nshards;
  size_t count;
  Wide<W, A> postscale;
  AccT hi;
  bool saturate;
  WireT* out;
  __device__ void operator()(size_t i) const {
    if (i >= count) {
      out[i] = Elem<W>::Store(0);
      return;
    }
    AccT s = static_cast<AccT>(Elem<W>::Load(rank == 0 ? own[i] : shards[i]));
    for (int q = 1; q < nshards; ++q) {
      s += static_cast<AccT>(Elem<W>::Load(q == rank ? own[i] : shards[q * stride + i]));
    }
    if (saturate && isfinite(s)) s = s > hi ? hi : (s < -hi ? -hi : s);
    out[i] = Elem<W>::Store(static_cast<Wide<W, A>>(Elem<A>::Load(s)) * postscale);
  }
};

template <DType W, DType A>
cudaError_t ReduceShardsTyped(cudaStream_t stream, const void* shards, size_t stride,
                              const void* own, int rank, int nshards, size_t count, size_t padded,
                              double postscale, bool saturate, void* out) {
  using Op = ReduceShardsOp<W, A>;
  Op op{static_cast<const typename Op::WireT*>(shards),
        stride,
        static_cast<const typename Op::WireT*>(own),
        rank,
        nshards,
        count,
        static_cast<Wide<W, A>>(postscale),
        static_cast<typename Op::AccT>(
            std::min<double>(MaxFinite(W), std::numeric_limits<typename Op::AccT>::max())),
        saturate,
        static_cast<typename Op::WireT*>(out)};
  Elementwise<<<Blocks(padded), kThreads, 0, stream>>>(padded, op);
  return cudaGetLastError();
}

template <DType A>
cudaError_t ReduceShardsInto(cudaStream_t stream, const void* shards, size_t stride,
                             const void* own, int rank, int nshards, DType wire, size_t count,
                             size_t padded, double postscale, bool saturate, void* out) {
  switch (wire) {
    case DType::kF32:
      return ReduceShardsTyped<DType::kF32, A>(stream, shards, stride, own, rank, nshards, count,
                                               padded, postscale, saturate, out);
    case DType::kF16:
      return ReduceShardsTyped<DType::kF16, A>(stream, shards, stride, own, rank, nshards, count,
                                               padded, postscale, saturate, out);
    case DType::kBF16:
      return ReduceShardsTyped<DType::kBF16, A>(stream, shards, stride, own, rank, nshards, count,
                                                padded, postscale, saturate, out);
    case DType::kF64:
      return ReduceShardsTyped<DType::kF64, A>(stream, shards, stride, own, rank, nshards, count,
                                               padded, postscale, saturate, out);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

void CudaKernels::Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess && status_.ok()) status_ = FromCuda(err, what);
}

void CudaKernels::Convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n,
                          double scale) {
  if (n == 0) return;
  cudaError_t err = cudaErrorInvalidValue;
  switch (dst_type) {
    case DType::kF32:
      err = ConvertTo<DType::kF32>(stream_, dst, src, src_type, n, scale);
      break;
    case DType::kF16:
      err = ConvertTo<DType::kF16>(stream_, dst, src, src_type, n, scale);
      break;
    case DType::kBF16:
      err = ConvertTo<DType::kBF16>(stream_, dst, src, src_type, n, scale);
      break;
    case DType::kF64:
      err = ConvertTo<DType::kF64>(stream_, dst, src, src_type, n, scale);
      break;
  }
  Check(err, "convert kernel");
}

void CudaKernels::Accumulate(void* acc, DType acc_type, const void* src, DType src_type, size_t n) {
  if (n == 0) return;
  // Accumulators are only ever float32 or float64 (AccumulatorFor).
  Check(acc_type == DType::kF64 ? AccumulateInto<DType::kF64>(stream_, acc, src, src_type, n)
                                : AccumulateInto<DType::kF32>(stream_, acc, src, src_type, n),
        "accumulate kernel");
}

void CudaKernels::Saturate(void* acc, DType acc_type, DType wire, size_t n) {
  if (n == 0) return;
  Check(acc_type == DType::kF64 ? SaturateTyped<double>(stream_, acc, MaxFinite(wire), n)
                                : SaturateTyped<float>(stream_, acc, MaxFinite(wire), n),
        "saturate kernel");
}

void CudaKernels::Zero(void* dst, size_t bytes) {
  if (bytes > 0) Check(cudaMemsetAsync(dst, 0, bytes, stream_), "cudaMemsetAsync");
}

Status LaunchChunkOffsets(cudaStream_t stream, const bool* mask, int64_t nchunks,
                          int32_t* offsets) {
  ChunkOffsetsKernel<<<1, kScanThreads, 0, stream>>>(mask, nchunks, offsets);
  return FromCuda(cudaGetLastError(), "chunk offsets kernel");
}

Status LaunchPackChunks(cudaStream_t stream, const void* x, size_t n, size_t elem_bytes,
                        const bool* mask, const int32_t* offsets, int64_t chunk_size, int64_t slots,
                        void* packed) {
  return LaunchChunkCopy<true>(stream, x, packed, n, elem_bytes, mask, offsets, chunk_size, slots);
}

Status LaunchZeroPackedTail(cudaStream_t stream, const bool* mask, const int32_t* offsets,
                            int64_t nchunks, int64_t chunk_size, size_t n, size_t size,
                            size_t elem_bytes, void* packed) {
  if (size == 0) return Status::Ok();
  cudaError_t err;
  switch (elem_bytes) {
    case 2:
      err = ZeroPackedTailTyped<uint16_t>(stream, mask, offsets, nchunks, chunk_size, n, size,
                                          packed);
      break;
    case 4:
      err = ZeroPackedTailTyped<uint32_t>(stream, mask, offsets, nchunks, chunk_size, n, size,
                                          packed);
      break;
    case 8:
      err = ZeroPackedTailTyped<uint64_t>(stream, mask, offsets, nchunks, chunk_size, n, size,
                                          packed);
      break;
    default:
      return Status(Code::kInvalidArgument, "jaxcomm: element size must be 2, 4 or 8 bytes");
  }
  return FromCuda(err, "zero packed tail kernel");
}

Status LaunchUnpackChunks(cudaStream_t stream, const void* packed, size_t n, size_t elem_bytes,
                          const bool* mask, const int32_t* offsets, int64_t chunk_size,
                          int64_t slots, void* y) {
  return LaunchChunkCopy<false>(stream, packed, y, n, elem_bytes, mask, offsets, chunk_size, slots);
}

Status LaunchChunkL1Norms(cudaStream_t stream, const void* x, DType type, size_t n,
                          int64_t chunk_size, float* norms) {
  if (n == 0) return Status::Ok();
  const int64_t nchunks = ChunkCount(n, chunk_size);
  if (nchunks > 0x7fffffffLL) {
    return Status(Code::kInvalidArgument, "jaxcomm: too many chunks for one launch");
  }
  const unsigned grid = static_cast<unsigned>(nchunks);
  switch (type) {
    case DType::kF32:
      ChunkL1NormsKernel<DType::kF32>
          <<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), n, chunk_size, norms);
      break;
    case DType::kF16:
      ChunkL1NormsKernel<DType::kF16>
          <<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(x), n, chunk_size, norms);
      break;
    case DType::kBF16:
      ChunkL1NormsKernel<DType::kBF16><<<grid, kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(x), n, chunk_size, norms);
      break;
    case DType::kF64:
      ChunkL1NormsKernel<DType::kF64>
          <<<grid, kThreads, 0, stream>>>(static_cast<const double*>(x), n, chunk_size, norms);
      break;
  }
  return FromCuda(cudaGetLastError(), "chunk L1 norms kernel");
}

Status LaunchEncode(cudaStream_t stream, const void* in, DType input, void* wire, DType wire_type,
                    size_t n, double prescale, bool saturate) {
  if (n == 0) return Status::Ok();
  cudaError_t err = cudaErrorInvalidValue;
  switch (input) {
    case DType::kF32:
      err = EncodeFrom<DType::kF32>(stream, in, wire, wire_type, n, prescale, saturate);
      break;
    case DType::kF16:
      err = EncodeFrom<DType::kF16>(stream, in, wire, wire_type, n, prescale, saturate);
      break;
    case DType::kBF16:
      err = EncodeFrom<DType::kBF16>(stream, in, wire, wire_type, n, prescale, saturate);
      break;
    case DType::kF64:
      err = EncodeFrom<DType::kF64>(stream, in, wire, wire_type, n, prescale, saturate);
      break;
  }
  return FromCuda(err, "encode kernel");
}

Status LaunchReduceShards(cudaStream_t stream, const void* shards, size_t stride, const void* own,
                          int rank, int nshards, DType wire, DType acc, size_t count, size_t padded,
                          double postscale, bool saturate, void* out) {
  if (padded == 0) return Status::Ok();
  // Accumulators are only ever float32 or float64 (AccumulatorFor).
  const cudaError_t err =
      acc == DType::kF64
          ? ReduceShardsInto<DType::kF64>(stream, shards, stride, own, rank, nshards, wire, count,
                                          padded, postscale, saturate, out)
          : ReduceShardsInto<DType::kF32>(stream, shards, stride, own, rank, nshards, wire, count,
                                          padded, postscale, saturate, out);
  return FromCuda(err, "reduce shards kernel");
}

}  // namespace jaxcomm::cuda
