// What one ncclSend/ncclRecv group costs the host on a non-blocking NCCL
// communicator (jaxcomm's own communicators are non-blocking, so that a rank
// that never arrives cannot hang the host, and its ring issues one such
// group per step) against a blocking one. ncclGroupEnd returns
// ncclInProgress when it has handed the launch to a new thread, ncclSuccess
// when it launched on the caller's. One GPU, one rank sending to itself.
// Built and run by tools/gpu_check.sh; prints one line:
//   nccl V groups N nonblocking_in_progress K nonblocking_us U blocking_in_progress K blocking_us U
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <vector>

namespace {

constexpr int kGroups = 200;
constexpr size_t kCount = 1 << 16;

// Polls until the last call on `comm` has been issued.
ncclResult_t Await(ncclComm_t comm) {
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress) {
    if (ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) return r;
  }
  return state;
}

struct Cost {
  int in_progress = 0;
  double us_per_group = 0;
  bool ok = false;
};

// kGroups send/recv groups on a new one-rank communicator; the data must
// come back unchanged.
Cost Measure(bool blocking, cudaStream_t stream, const float* send, float* recv,
             const std::vector<float>& want) {
  Cost cost;
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) return cost;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking ? 1 : 0;
  ncclComm_t comm;
  ncclResult_t r = ncclCommInitRankConfig(&comm, 1, id, 0, &config);
  if ((r != ncclSuccess && r != ncclInProgress) || Await(comm) != ncclSuccess) return cost;
  cudaMemsetAsync(recv, 0, kCount * sizeof(float), stream);
  const auto start = std::chrono::steady_clock::now();
  for (int g = 0; g < kGroups; ++g) {
    ncclGroupStart();
    ncclSend(send, kCount, ncclFloat, 0, comm, stream);
    ncclRecv(recv, kCount, ncclFloat, 0, comm, stream);
    r = ncclGroupEnd();
    if (r == ncclInProgress) ++cost.in_progress;
    if ((r != ncclSuccess && r != ncclInProgress) || Await(comm) != ncclSuccess) return cost;
  }
  const auto end = std::chrono::steady_clock::now();
  cost.us_per_group = std::chrono::duration<double, std::micro>(end - start).count() / kGroups;
  cudaStreamSynchronize(stream);
  std::vector<float> back(kCount);
  cudaMemcpy(back.data(), recv, kCount * sizeof(float), cudaMemcpyDeviceToHost);
  cost.ok = back == want;
  ncclCommDestroy(comm);
  return cost;
}

}  // namespace

int main() {
  if (cudaSetDevice(0) != cudaSuccess) {
    std::printf("FAILED: no GPU\n");
    return 1;
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  float *send = nullptr, *recv = nullptr;
  cudaMalloc(&send, kCount * sizeof(float));
  cudaMalloc(&recv, kCount * sizeof(float));
  std::vector<float> host(kCount);
  for (size_t i = 0; i < kCount; ++i) host[i] = static_cast<float>(i % 251);
  cudaMemcpy(send, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice);
  const Cost nonblocking = Measure(false, stream, send, recv, host);
  const Cost blocking = Measure(true, stream, send, recv, host);
  int version = 0;
  ncclGetVersion(&version);
  std::printf(
      "nccl %d groups %d nonblocking_in_progress %d nonblocking_us %.1f blocking_in_progress %d "
      "blocking_us %.1f\n",
      version, kGroups, nonblocking.in_progress, nonblocking.us_per_group, blocking.in_progress,
      blocking.us_per_group);
  if (!nonblocking.ok || !blocking.ok) {
    std::printf("FAILED: a group failed or the data came back wrong\n");
    return 1;
  }
  return 0;
}
