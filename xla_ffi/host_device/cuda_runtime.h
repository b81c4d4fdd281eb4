// A host "device" for the CUDA backend's host code (JAXCOMM_HOST_DEVICE
// builds, see cuda/runtime.h): the part of the CUDA runtime API that code
// calls, with host memory as device memory and each stream an in-order queue
// run by its own host thread. Test-only: the tests compile the CUDA
// handlers' host logic against it with the host compiler.
#pragma once

#include <cstddef>
#include <functional>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorNotReady = 600,
};
using cudaError = cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

constexpr unsigned cudaEventDisableTiming = 2;
constexpr unsigned cudaStreamNonBlocking = 1;

namespace jaxcomm::host_device {
class Stream;
class Event;
}  // namespace jaxcomm::host_device
using cudaStream_t = jaxcomm::host_device::Stream*;
using cudaEvent_t = jaxcomm::host_device::Event*;

const char* cudaGetErrorName(cudaError_t err);
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
// A new stream of its own thread; `flags` are accepted and ignored (no
// legacy default stream here to block on).
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
// Work issued on `stream` after this call runs once the work issued before
// `event`'s last record (on its stream, at the time of this call) is done;
// an event never recorded is no wait, as in CUDA.
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags);
// Stream-ordered memory: the block is usable by work issued after the
// allocation (host memory exists at once) and released when `stream` reaches
// the free.
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventDestroy(cudaEvent_t event);

namespace jaxcomm::host_device {

// A stream: work runs in order on the stream's own thread. Enqueue is what a
// kernel launch, a copy or an NCCL call does; tests make one per rank.
cudaStream_t NewStream();
void DeleteStream(cudaStream_t stream);
void Enqueue(cudaStream_t stream, std::function<void()> work);

// How often this thread has waited for a stream (cudaStreamSynchronize):
// a handler that waits stalls XLA's launches behind it.
int HostWaits();

}  // namespace jaxcomm::host_device
