// What the CUDA collective handlers share: running a call's work on its
// communicators (jaxcomm's own, or XLA's where the FFI lends them), and the
// allreduce schedules behind one call.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "algorithm/schedule.h"
#include "common/algorithm_code.h"
#include "cuda/comm_set.h"
#include "cuda/communicators.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

namespace ffi = xla::ffi;

// The contexts every collective handler binds first: XLA's stream, the device
// (it picks the communicator) and the call's context (scratch memory).
inline auto BindCollectiveContexts() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::Context>();
}

// What a handler issues on its communicators, whoever owns them.
using CollectiveBody = std::function<Status(const CommSet&, CudaKernels&)>;
// Runs a body on one call's communicators: handlers are written once against
// this and bound twice, to jaxcomm's own communicators and to XLA's.
using CommRunner = std::function<Status(const CollectiveBody&)>;

// jaxcomm's own communicators: finds (first call: creates) this device's for
// `op_id`, runs `body` with them locked, and hands the enqueued work to the
// watchdog.
Status RunOnOwnComms(cudaStream_t stream, int device, const int32_t* coords, int64_t op_id,
                     int nranks, const CollectiveBody& body, Lane lane = Lane::kInStep);

// n contiguous elements, reduced with `algorithm` over the set's group:
// kDirect is ncclAllReduce where NCCL adds in the accumulator type (float32
// or float64 input, no wire cast) and kAllToAll otherwise.
Status ReduceContiguous(const CommSet& set, CudaKernels& k, cudaStream_t stream, Scratch& scratch,
                        Algorithm algorithm, int intra_size, const ReduceSpec& spec, const void* in,
                        void* out, size_t n);

}  // namespace jaxcomm::cuda
