// The CUDA FFI handlers this library registers with XLA (platform "CUDA").
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cuda {
extern "C" XLA_FFI_Error* AllReduceCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* ReduceScatterCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AllGatherCuda(XLA_FFI_CallFrame* call_frame);
// The started allreduce and its done call, on jaxcomm's own communicators
// and stream (cuda/allreduce_async.cc).
extern "C" XLA_FFI_Error* AllReduceStartCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AllReduceDoneCuda(XLA_FFI_CallFrame* call_frame);
// The kernels on their own, for tests and benchmarks (testing_registrations).
extern "C" XLA_FFI_Error* ChunkNormsCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* CastCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* PackChunksCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* UnpackChunksCuda(XLA_FFI_CallFrame* call_frame);
// The collectives on XLA's communicators (where cuda/xla_comms.h has
// JAXCOMM_XLA_COMMS): registered with PrepareXlaComms as their Prepare stage.
extern "C" XLA_FFI_Error* AllReduceCudaXlaComms(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* ReduceScatterCudaXlaComms(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AllGatherCudaXlaComms(XLA_FFI_CallFrame* call_frame);
}  // namespace jaxcomm::cuda
