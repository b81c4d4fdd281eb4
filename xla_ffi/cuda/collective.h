// What the CUDA collective handlers share: finding this device's
// communicators, locking them while work is issued, and the allreduce
// schedules behind one call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "algorithm/schedule.h"
#include "cuda/communicators.h"
#include "cuda/kernels.h"
#include "cuda/scratch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

// Integer codes shared with jaxcomm/collectives/_ffi.py (ALGORITHM_CODES).
// kDirect has no shared-memory meaning on GPU; it selects NCCL's own
// ncclAllReduce where no wire cast is asked for (see ReduceContiguous).
enum class Algorithm : int32_t { kRing = 0, kHierarchical = 1, kDirect = 2 };

// Finds this device's communicators for `op_id`, runs `body` with them
// locked, and hands the enqueued work to the watchdog.
Status RunCollective(cudaStream_t stream, int device, const int32_t* coords, int64_t op_id,
                     int nranks, const std::function<Status(RankComms&, CudaKernels&)>& body);

// n contiguous elements, reduced with `algorithm` over rc's group.
Status ReduceContiguous(RankComms& rc, CudaKernels& k, cudaStream_t stream, Scratch& scratch,
                        Algorithm algorithm, int intra_size, const ReduceSpec& spec, const void* in,
                        void* out, size_t n);

}  // namespace jaxcomm::cuda
