#include "cuda/communicators.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <list>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "cuda/check.h"

namespace jaxcomm::cuda {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<double> timeout_seconds{300.0};

Clock::time_point Deadline() {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(TimeoutSeconds()));
}

// NCCL's set-up job stores the handle from its own thread.
ncclComm_t LoadHandle(const ncclComm_t& slot) { return __atomic_load_n(&slot, __ATOMIC_ACQUIRE); }

ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// Aborts every communicator of rc; caller holds rc.mu. ncclCommAbort also
// releases kernels still waiting on peers, so the stream can drain.
void AbortLocked(RankComms& rc, const std::string& why) {
  if (!rc.failure.empty()) return;
  rc.failure = why;
  for (auto& [size, split] : rc.splits) {
    if (split.intra) ncclCommAbort(split.intra);
    if (split.inter) ncclCommAbort(split.inter);
  }
  rc.splits.clear();
  if (rc.flat) ncclCommAbort(rc.flat);
  rc.flat = nullptr;
}

std::string VersionString(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." +
         std::to_string(code % 100);
}

// The libnccl.so.2 found at run time must be at least as new (major.minor)
// as the headers this module was compiled with: an older one lacks calls and
// config fields used here, and would fail far from the cause.
Status CheckNcclVersion() {
  int runtime = 0;
  JAXCOMM_NCCL_RETURN_IF_ERROR(ncclGetVersion(&runtime), nullptr);
  if (runtime / 100 < NCCL_VERSION_CODE / 100) {
    return Status(Code::kInternal, "jaxcomm: built against NCCL " +
                                       VersionString(NCCL_VERSION_CODE) +
                                       " but the loaded libnccl.so.2 is " + VersionString(runtime) +
                                       "; install a matching nvidia-nccl-cu13 or rebuild jaxcomm");
  }
  return Status::Ok();
}

// The ranks of one group meeting for the first call of a site, in one process.
struct Pending {
  std::vector<int> devices;  // by rank; -1 = not arrived
  int arrived = 0;
  int left = 0;
  bool ready = false;
  bool create = false;  // true: first use of this device set, init the communicators
  ncclUniqueId id;
  Status status;
  std::shared_ptr<std::vector<RankComms>> group;
};

// Process-wide on purpose: communicators belong to device groups, not to one
// call site or one executable, and are shared by all of them. Never
// destroyed: tearing NCCL down during static destruction can hang.
class Registry {
 public:
  static Registry& Get() {
    static Registry* registry = new Registry();
    return *registry;
  }

  RankComms* Cached(int64_t op_id, int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_call_.find({op_id, device});
    return it == by_call_.end() ? nullptr : it->second;
  }

  Status Join(int64_t op_id, int device, int64_t group, int rank, int nranks, Lane lane,
              RankComms** out);

  void Register(int64_t op_id, int64_t group, const ncclUniqueId& id) {
    std::lock_guard<std::mutex> lock(mu_);
    ids_[{op_id, group}] = id;
  }

  void Watch(RankComms* rc, cudaEvent_t start, cudaEvent_t end);

 private:
  Status InitRank(RankComms& rc, const ncclUniqueId& id);
  void WatchdogLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int64_t, int>, RankComms*> by_call_;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<Pending>> pending_;
  std::map<std::pair<Lane, std::vector<int>>, std::shared_ptr<std::vector<RankComms>>> by_devices_;
  std::map<std::pair<int64_t, int64_t>, ncclUniqueId> ids_;
  std::list<RankComms> per_site_;  // several processes: one group per site

  struct Watched {
    RankComms* rc;
    cudaEvent_t start;           // the call's work begins; null once passed
    cudaEvent_t end;             // the call's work is done
    Clock::time_point deadline;  // set when start has passed
  };
  std::mutex watch_mu_;
  std::deque<Watched> watched_;
  bool watchdog_started_ = false;
};

Status Registry::InitRank(RankComms& rc, const ncclUniqueId& id) {
  std::lock_guard<std::mutex> lock(rc.mu);
  static const Status version = CheckNcclVersion();
  JAXCOMM_RETURN_IF_ERROR(version);
  ScopedDevice scoped(rc.device);
  JAXCOMM_RETURN_IF_ERROR(scoped.status());
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t& slot = rc.handle_slots.emplace_back(nullptr);
  Status st = FromNccl(ncclCommInitRankConfig(&slot, rc.size, id, rc.rank, &config),
                       "ncclCommInitRankConfig");
  if (st.ok()) {
    // Set before the call returns; the job stores the same handle again at its end.
    rc.flat = LoadHandle(slot);
    st = Await(rc, rc.flat, "ncclCommInitRankConfig");
  }
  if (!st.ok() && rc.failure.empty()) rc.failure = st.message();
  return st;
}

Status Registry::Join(int64_t op_id, int device, int64_t group, int rank, int nranks, Lane lane,
                      RankComms** out) {
  std::unique_lock<std::mutex> lock(mu_);
  if (auto it = ids_.find({op_id, group}); it != ids_.end()) {
    // Several processes: the peers are not all here, so no device-set cache.
    const ncclUniqueId id = it->second;
    RankComms& rc = per_site_.emplace_back();
    rc.device = device;
    rc.rank = rank;
    rc.size = nranks;
    lock.unlock();
    JAXCOMM_RETURN_IF_ERROR(InitRank(rc, id));
    lock.lock();
    by_call_[{op_id, device}] = *out = &rc;
    return Status::Ok();
  }

  std::shared_ptr<Pending>& slot = pending_[{op_id, group}];
  if (!slot) {
    slot = std::make_shared<Pending>();
    slot->devices.assign(nranks, -1);
  }
  std::shared_ptr<Pending> p = slot;
  if (static_cast<int>(p->devices.size()) != nranks || p->devices[rank] != -1) {
    return Status(Code::kInvalidArgument,
                  "jaxcomm: ranks of call site " + std::to_string(op_id) +
                      " disagree on the group size, or two devices claim rank " +
                      std::to_string(rank));
  }
  p->devices[rank] = device;
  if (++p->arrived == nranks) {
    auto it = by_devices_.find({lane, p->devices});
    if (it != by_devices_.end()) {
      p->group = it->second;
    } else {
      p->create = true;
      p->status = NewUniqueId(&p->id);
      p->group = std::make_shared<std::vector<RankComms>>(nranks);
      if (p->status.ok()) by_devices_[{lane, p->devices}] = p->group;
    }
    p->ready = true;
    cv_.notify_all();
  } else if (!cv_.wait_until(lock, Deadline(), [&] { return p->ready; })) {
    std::string missing;
    for (int r = 0; r < nranks; ++r) {
      if (p->devices[r] == -1) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    return Status(Code::kDeadlineExceeded,
                  "jaxcomm: timed out after " + std::to_string(TimeoutSeconds()) +
                      " s waiting for ranks [" + missing + "] of group " + std::to_string(group) +
                      " (one process needs one thread per GPU; several processes need "
                      "jax.distributed.initialize before the first call)");
  }
  if (++p->left == nranks) pending_.erase({op_id, group});
  JAXCOMM_RETURN_IF_ERROR(p->status);
  RankComms& rc = (*p->group)[rank];
  if (p->create) {
    rc.device = device;
    rc.rank = rank;
    rc.size = nranks;
    const ncclUniqueId id = p->id;
    lock.unlock();
    JAXCOMM_RETURN_IF_ERROR(InitRank(rc, id));
    lock.lock();
  }
  by_call_[{op_id, device}] = *out = &rc;
  return Status::Ok();
}

void Registry::Watch(RankComms* rc, cudaEvent_t start, cudaEvent_t end) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  watched_.push_back({rc, start, end, Clock::time_point::max()});
  if (!watchdog_started_) {
    watchdog_started_ = true;
    std::thread([this] { WatchdogLoop(); }).detach();
  }
}

void Registry::WatchdogLoop() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::vector<Watched> expired;
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      const Clock::time_point now = Clock::now();
      // The clock starts when the work queued ahead of a call is done (its
      // start event passed), so a long queue never counts against it; an end
      // event still pending past the deadline means a peer never joined.
      for (auto it = watched_.begin(); it != watched_.end();) {
        // CUDA allows querying another device's event, but this thread has
        // no device of its own; the event's device keeps the destroy (and
        // any context CUDA needs) on the right GPU.
        ScopedDevice scoped(it->rc->device);
        if (it->start != nullptr && cudaEventQuery(it->start) != cudaErrorNotReady) {
          cudaEventDestroy(it->start);
          it->start = nullptr;
          it->deadline = Deadline();
        }
        const cudaError_t q = cudaEventQuery(it->end);
        if (q == cudaErrorNotReady && now < it->deadline) {
          ++it;
          continue;
        }
        if (q == cudaErrorNotReady) expired.push_back(*it);
        if (it->start != nullptr) cudaEventDestroy(it->start);
        cudaEventDestroy(it->end);
        it = watched_.erase(it);
      }
    }
    for (const Watched& w : expired) {
      std::lock_guard<std::mutex> lock(w.rc->mu);
      AbortLocked(*w.rc, "jaxcomm: an NCCL collective on device " + std::to_string(w.rc->device) +
                             " did not finish within " + std::to_string(TimeoutSeconds()) +
                             " s (a peer never joined?); its communicator was aborted");
    }
  }
}

}  // namespace

void SetTimeoutSeconds(double seconds) { timeout_seconds.store(seconds); }
double TimeoutSeconds() { return timeout_seconds.load(); }

ScopedDevice::ScopedDevice(int device) {
  status_ = FromCuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (status_.ok() && previous_ != device) {
    status_ = FromCuda(cudaSetDevice(device), "cudaSetDevice");
  }
}

ScopedDevice::~ScopedDevice() {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && previous_ >= 0 && current != previous_) {
    cudaSetDevice(previous_);
  }
}

Status NewUniqueId(ncclUniqueId* id) {
  JAXCOMM_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(id), nullptr);
  return Status::Ok();
}

void RegisterUniqueId(int64_t op_id, int64_t group, const ncclUniqueId& id) {
  Registry::Get().Register(op_id, group, id);
}

Status CommsForCall(cudaStream_t stream, const int32_t* coords, int64_t op_id, int device,
                    int nranks, RankComms** out, Lane lane) {
  Registry& registry = Registry::Get();
  if ((*out = registry.Cached(op_id, device)) != nullptr) return Status::Ok();
  // First call of this site on this device: the placement is static per
  // device, so reading it (and synchronizing) once is enough.
  int32_t host[2] = {0, 0};
  JAXCOMM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, coords, sizeof(host), cudaMemcpyDeviceToHost, stream));
  JAXCOMM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (nranks < 1 || host[1] < 0 || host[1] >= nranks) {
    return Status(Code::kInvalidArgument, "jaxcomm: rank " + std::to_string(host[1]) +
                                              " is outside a group of " + std::to_string(nranks));
  }
  return registry.Join(op_id, device, host[0], host[1], nranks, lane, out);
}

namespace {

// One ncclCommSplit of rc.flat. The new handle is only stored when NCCL's
// set-up job ends, which the wait on the parent covers.
Status SplitOne(RankComms& rc, int color, int key, const char* what, ncclComm_t* out) {
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t& slot = rc.handle_slots.emplace_back(nullptr);
  JAXCOMM_NCCL_RETURN_IF_ERROR(ncclCommSplit(rc.flat, color, key, &slot, &config), rc.flat);
  JAXCOMM_RETURN_IF_ERROR(Await(rc, rc.flat, what));
  const ncclComm_t comm = LoadHandle(slot);
  if (comm == nullptr) {
    const std::string msg = std::string("jaxcomm: ") + what + " gave no communicator";
    AbortLocked(rc, msg);
    return Status(Code::kInternal, msg);
  }
  JAXCOMM_RETURN_IF_ERROR(Await(rc, comm, what));
  *out = comm;
  return Status::Ok();
}

}  // namespace

Status SplitFor(RankComms& rc, int intra_size, RankComms::Split* out) {
  if (auto it = rc.splits.find(intra_size); it != rc.splits.end()) {
    *out = it->second;
    return Status::Ok();
  }
  const int node = rc.rank / intra_size, local = rc.rank % intra_size;
  RankComms::Split split;
  JAXCOMM_RETURN_IF_ERROR(SplitOne(rc, node, local, "ncclCommSplit (intra)", &split.intra));
  JAXCOMM_RETURN_IF_ERROR(SplitOne(rc, local, node, "ncclCommSplit (inter)", &split.inter));
  rc.splits[intra_size] = *out = split;
  return Status::Ok();
}

Status Await(RankComms& rc, ncclComm_t comm, const char* what) {
  const Clock::time_point deadline = Deadline();
  for (;;) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t res = ncclCommGetAsyncError(comm, &async);
    if (res != ncclSuccess) async = res;
    if (async == ncclSuccess) return Status::Ok();
    if (async != ncclInProgress) {
      Status st = FromNccl(async, what, comm);
      AbortLocked(rc, st.message());
      return st;
    }
    if (Clock::now() > deadline) {
      const std::string msg = std::string("jaxcomm: ") + what + " on device " +
                              std::to_string(rc.device) + " made no progress for " +
                              std::to_string(TimeoutSeconds()) + " s; the communicator was aborted";
      AbortLocked(rc, msg);
      return Status(Code::kDeadlineExceeded, msg);
    }
    std::this_thread::yield();
  }
}

Status RecordEvent(cudaStream_t stream, cudaEvent_t* out) {
  *out = nullptr;
  cudaEvent_t event;
  JAXCOMM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  if (cudaError_t err = cudaEventRecord(event, stream); err != cudaSuccess) {
    cudaEventDestroy(event);
    return FromCuda(err, "cudaEventRecord");
  }
  *out = event;
  return Status::Ok();
}

Status Watch(RankComms& rc, cudaStream_t stream, cudaEvent_t start) {
  cudaEvent_t end;
  if (Status st = RecordEvent(stream, &end); !st.ok()) {
    cudaEventDestroy(start);
    return st;
  }
  Registry::Get().Watch(&rc, start, end);
  return Status::Ok();
}

}  // namespace jaxcomm::cuda
