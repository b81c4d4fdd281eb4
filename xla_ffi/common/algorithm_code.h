// Which schedule a collective call runs (the `algorithm` attribute); Python
// reads the codes from codes() (common/python_codes.h).
#pragma once

#include <cstdint>

#include "common/codes.h"

namespace jaxcomm {

// kDirect: on CPU, every rank reads the others' buffers in shared memory; on
// GPU, NCCL's own ncclAllReduce where NCCL adds in the accumulator type
// (float32 or float64 with no wire cast), kAllToAll otherwise.
// kAllToAll (GPU only): the wire-typed shards in one grouped NCCL
// all-to-all, a float32 add of the shards, one ncclAllGather
// (cuda/alltoall.h); two NCCL launches, however many ranks.
enum class Algorithm : int32_t { kRing = 0, kHierarchical = 1, kDirect = 2, kAllToAll = 3 };
inline constexpr NamedCode<Algorithm> kAlgorithmNames[] = {
    {Algorithm::kRing, "ring"},
    {Algorithm::kHierarchical, "hierarchical"},
    {Algorithm::kDirect, "direct"},
    {Algorithm::kAllToAll, "alltoall"},
};

inline bool IsValidAlgorithm(int32_t code) { return IsNamedCode(kAlgorithmNames, code); }

}  // namespace jaxcomm
