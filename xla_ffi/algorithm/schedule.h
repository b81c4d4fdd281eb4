// Ring and hierarchical allreduce, reduce-scatter and allgather, written once
// over Transport + Kernels so the CPU and CUDA backends share them.
//
// Data layout: the flat input of n elements is cut into `size` contiguous
// chunks of ceil(n / size) elements (the last ones may be short or empty).
// Sums run in the accumulator type (float32, or float64 for float64 input);
// what travels is the wire type; every rank ends with bitwise the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/kernels.h"
#include "common/reduce_spec.h"
#include "common/status.h"
#include "common/transport.h"

namespace jaxcomm {

// [begin, end) of chunk `c` when n elements are cut into `parts` chunks.
struct Range {
  size_t begin;
  size_t end;
  size_t size() const { return end - begin; }
};
Range ChunkRange(size_t n, int parts, int c);

// Scratch a schedule needs, sized by AllReduceScratchBytes and carved up by
// the schedule itself: the caller only supplies one block.
size_t AllReduceScratchBytes(size_t n, const ReduceSpec& spec, int max_group);

// out = postscale * sum_ranks(prescale * in), ring over `t`.
Status RingAllReduce(Transport& t, Kernels& k, const ReduceSpec& spec, const void* in, void* out,
                     size_t n, void* scratch);

// Reduce-scatter inside `intra`, allreduce of the 1/L shard across `inter`,
// allgather inside `intra`. Rank = inter.rank() * intra.size() + intra.rank().
Status HierarchicalAllReduce(Transport& intra, Transport& inter, Kernels& k, const ReduceSpec& spec,
                             const void* in, void* out, size_t n, void* scratch);

// out (ceil(n/N) elements) = this rank's chunk of the reduced, zero-padded input.
size_t ReduceScatterScratchBytes(size_t n, const ReduceSpec& spec, int group);
Status RingReduceScatter(Transport& t, Kernels& k, const ReduceSpec& spec, const void* in,
                         void* out, size_t n, void* scratch);

// out (N * m elements) = every rank's m-element input, in rank order; the
// input travels as `wire` (a narrower wire rounds it).
size_t AllGatherScratchBytes(size_t m, DType input, DType wire, int group);
Status RingAllGather(Transport& t, Kernels& k, DType input, DType wire, const void* in, void* out,
                     size_t m, void* scratch);

}  // namespace jaxcomm
