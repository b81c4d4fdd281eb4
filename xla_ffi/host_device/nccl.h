// A loopback "NCCL" on host threads (JAXCOMM_HOST_DEVICE builds, see
// cuda/runtime.h): the NCCL API the CUDA backend calls, with ranks as host
// threads in one process. Point-to-point transfers go through mailboxes
// between ranks; collectives run on the streams of host_device/cuda_runtime.h.
// Faults can be injected (Faults below): a call that reports ncclInProgress
// for a while, a call that fails, a receive that never completes (a hang, until
// the communicator is aborted) or completes late.
#pragma once

#include <cstddef>
#include <cstdint>

#include "host_device/cuda_runtime.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 9
#define NCCL_VERSION_CODE (NCCL_MAJOR * 10000 + NCCL_MINOR * 100 + NCCL_PATCH)
#define NCCL_SPLIT_NOCOLOR -1

enum ncclResult_t {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};

enum ncclDataType_t {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
};

enum ncclRedOp_t { ncclSum = 0 };

struct ncclUniqueId {
  char internal[128];
};

struct ncclConfig_t {
  int blocking;
};
#define NCCL_CONFIG_INITIALIZER {1}

namespace jaxcomm::host_device {
class Comm;
}  // namespace jaxcomm::host_device
using ncclComm_t = jaxcomm::host_device::Comm*;

const char* ncclGetErrorString(ncclResult_t result);
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetVersion(int* version);
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out,
                           ncclConfig_t* config);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async);
ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank);
ncclResult_t ncclCommCount(ncclComm_t comm, int* count);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);

namespace jaxcomm::host_device {

// Faults the next NCCL calls of this process run into; all counts are calls
// of any rank, counted down as they happen. Reset() clears them.
struct Faults {
  int in_progress_polls = 0;  // ncclCommGetAsyncError says ncclInProgress this often first
  int fail_calls = 0;         // this many ncclSend/ncclRecv/ncclAllGather/ncclAllReduce fail
  int hang_recvs = 0;         // this many receives never complete (until an abort)
  double late_seconds = 0;    // every receive completes this much later than its send
};
Faults& InjectedFaults();
void ResetFaults();

// NCCL launches this thread has made: a group (or a lone send or receive)
// and a collective count one each, as each is one kernel on a real GPU.
int NcclLaunches();

}  // namespace jaxcomm::host_device
