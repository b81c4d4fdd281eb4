// The allreduce schedules of the CPU backend behind one call, shared by the
// FFI handler and the pybind11 thread harness.
#pragma once

#include "algorithm/schedule.h"
#include "cpu/collective.h"

namespace jaxcomm::cpu {

// Runs `algorithm` on n contiguous elements over the rings of `rings`.
Status ReduceContiguous(Rings& rings, Algorithm algorithm, const ReduceSpec& spec, const void* in,
                        void* out, size_t n);

}  // namespace jaxcomm::cpu
