// NCCL communicators, created once per device group and reused by every call
// site that reduces over the same devices.
//
// Only for jaxlibs without xla/ffi/api/collectives_api.h (0.10.x), where XLA
// cannot lend a handler its own communicators (cuda/xla_comms.h does that
// elsewhere). One process driving several GPUs: the ranks of a
// group meet in a process-local rendezvous, learn the group's devices, and
// either reuse that group's communicators or create them with
// ncclCommInitRank on their own threads. Several processes: Python shares a
// unique id per (call site, group) through the jax.distributed key-value
// store and registers it here before the first call (RegisterUniqueId).
//
// Communicators are non-blocking (config.blocking = 0), so no NCCL call can
// hang the host: Await polls ncclCommGetAsyncError until a deadline, then
// aborts the communicator. A collective that never finishes on the device
// (counted from when the work queued ahead of it is done) is caught by a
// watchdog thread that aborts it the same way (Watch).
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <string>

#include "common/status.h"
#include "cuda/runtime.h"

namespace jaxcomm::cuda {

// Seconds a rendezvous, communicator set-up or collective may take.
void SetTimeoutSeconds(double seconds);
double TimeoutSeconds();

// One rank's communicators in one group. `mu` is held while work is issued,
// so the watchdog never aborts a communicator under a running handler.
struct RankComms {
  struct Split {
    ncclComm_t intra = nullptr;  // the ranks of this node, ordered by local index
    ncclComm_t inter = nullptr;  // the ranks with this local index, ordered by node
  };
  int device = -1;
  int rank = 0;
  int size = 0;
  ncclComm_t flat = nullptr;
  std::map<int, Split> splits;  // by ranks per node
  // Where NCCL stores the handle of a communicator it creates: its set-up
  // job writes it when it finishes, which may be after we stopped waiting
  // (timeout), so the slot must outlive the call. std::list: addresses stay.
  std::list<ncclComm_t> handle_slots;
  std::mutex mu;
  std::string failure;  // set when aborted: every later call returns it
};

// Which work a device group's communicators carry. NCCL runs the work of
// one communicator in the order it was issued, whatever the stream, so
// started allreduces (on jaxcomm's stream, cuda/allreduce_async.cc) get
// communicators of their own: an in-step collective issued while one is in
// flight then runs beside it instead of after it.
enum class Lane { kInStep, kStarted };

// Finds (first call: creates) this device's communicators for call site
// `op_id`. Reads the [group, rank] coords from device memory only on the
// first call of a site, which therefore synchronizes `stream` once.
Status CommsForCall(cudaStream_t stream, const int32_t* coords, int64_t op_id, int device,
                    int nranks, RankComms** out, Lane lane = Lane::kInStep);

// The intra/inter communicators for `intra_size` ranks per node (a divisor
// of rc.size, which the caller checked), split from rc.flat on first use
// (collective: every rank of the group calls it). Caller holds rc.mu.
Status SplitFor(RankComms& rc, int intra_size, RankComms::Split* out);

// Waits until the last non-blocking NCCL call on `comm` has been issued;
// on error or timeout aborts all of rc's communicators. Caller holds rc.mu.
Status Await(RankComms& rc, ncclComm_t comm, const char* what);

// A new event recorded on `stream` (the caller owns it).
Status RecordEvent(cudaStream_t stream, cudaEvent_t* out);

// Hands the work issued on `stream` since `start` (recorded with
// RecordEvent; Watch takes it over, also on failure) to the watchdog, which
// aborts rc's communicators if that work has not finished within the
// timeout of `start` passing on the GPU.
Status Watch(RankComms& rc, cudaStream_t stream, cudaEvent_t start);

// For several processes: the unique id every process uses for (op_id, group).
Status NewUniqueId(ncclUniqueId* id);
void RegisterUniqueId(int64_t op_id, int64_t group, const ncclUniqueId& id);

// Makes `device` current for the scope (handlers may run on any thread).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  Status status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

}  // namespace jaxcomm::cuda
