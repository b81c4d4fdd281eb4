// The CPU FFI handlers this library registers with XLA (platform "cpu").
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jaxcomm::cpu {
extern "C" XLA_FFI_Error* AllReduceCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* ReduceScatterCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AllGatherCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AfterCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* PoolCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AllReducePartsCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* ChunkL1Cpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* ChunkResidualCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AllReduceStartCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AllReduceDoneCpu(XLA_FFI_CallFrame* call_frame);
}  // namespace jaxcomm::cpu
