// Which schedule a collective call runs (the `algorithm` attribute); Python
// reads the codes from codes() (common/python_codes.h).
#pragma once

#include <cstdint>

#include "common/codes.h"

namespace jaxcomm {

// kDirect: on CPU, every rank reads the others' buffers in shared memory; on
// GPU, NCCL's own ncclAllReduce where no wire cast is asked for (the ring
// otherwise).
enum class Algorithm : int32_t { kRing = 0, kHierarchical = 1, kDirect = 2 };
inline constexpr NamedCode<Algorithm> kAlgorithmNames[] = {
    {Algorithm::kRing, "ring"},
    {Algorithm::kHierarchical, "hierarchical"},
    {Algorithm::kDirect, "direct"},
};

inline bool IsValidAlgorithm(int32_t code) { return IsNamedCode(kAlgorithmNames, code); }

}  // namespace jaxcomm
