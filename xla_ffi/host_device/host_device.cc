// The host "device" and loopback "NCCL" declared in cuda_runtime.h and
// nccl.h. Streams are queues run by one thread each, so work issued on a
// stream runs after the work issued before it and concurrently with the
// host, as on a GPU; a transfer is a message from one rank's mailbox to
// another's.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "host_device/cuda_runtime.h"
#include "host_device/nccl.h"

namespace jaxcomm::host_device {

using Clock = std::chrono::steady_clock;

// How far a stream has got; shared with the events recorded on it, which,
// as on a GPU, may be queried after the stream is gone.
struct Progress {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t issued = 0, completed = 0;
};

class Stream {
 public:
  Stream() : worker_([this] { Run(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(progress_->mu);
      stop_ = true;
    }
    progress_->cv.notify_all();
    worker_.join();
  }
  void Enqueue(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(progress_->mu);
    queue_.push_back(std::move(work));
    ++progress_->issued;
    progress_->cv.notify_all();
  }
  void Synchronize() {
    std::unique_lock<std::mutex> lock(progress_->mu);
    progress_->cv.wait(lock, [&] { return progress_->completed == progress_->issued; });
  }
  const std::shared_ptr<Progress>& progress() const { return progress_; }

 private:
  void Run() {
    Progress& p = *progress_;
    std::unique_lock<std::mutex> lock(p.mu);
    for (;;) {
      p.cv.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::function<void()> work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      work();
      lock.lock();
      ++p.completed;
      p.cv.notify_all();
    }
  }
  std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread worker_;  // last: starts once the rest exists
};

class Event {
 public:
  std::shared_ptr<Progress> progress;  // null: never recorded
  uint64_t ticket = 0;
};

cudaStream_t NewStream() { return new Stream(); }
void DeleteStream(cudaStream_t stream) { delete stream; }
void Enqueue(cudaStream_t stream, std::function<void()> work) { stream->Enqueue(std::move(work)); }

thread_local int host_waits = 0;
int HostWaits() { return host_waits; }

// ---- NCCL ----

Faults& InjectedFaults() {
  static Faults faults;
  return faults;
}
std::mutex& FaultsMu() {
  static std::mutex mu;
  return mu;
}
void ResetFaults() {
  std::lock_guard<std::mutex> lock(FaultsMu());
  InjectedFaults() = Faults();
}
namespace {
bool TakeFault(int Faults::*field) {
  std::lock_guard<std::mutex> lock(FaultsMu());
  int& left = InjectedFaults().*field;
  if (left <= 0) return false;
  --left;
  return true;
}
double LateSeconds() {
  std::lock_guard<std::mutex> lock(FaultsMu());
  return InjectedFaults().late_seconds;
}
}  // namespace

// The ranks of one communicator: a FIFO mailbox per (from, to) pair.
struct Clique {
  struct Message {
    std::vector<char> bytes;
    Clock::time_point ready;
  };
  explicit Clique(int size) : size(size) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<int, int>, std::deque<Message>> mail;
  // ncclCommSplit rounds: every rank's (color, key), then the new cliques.
  struct SplitRound {
    std::vector<std::pair<int, int>> votes;
    int arrived = 0;
    std::map<int, std::shared_ptr<Clique>> children;
  };
  std::map<int, SplitRound> splits;
};

class Comm {
 public:
  Comm(std::shared_ptr<Clique> clique, int rank) : clique(std::move(clique)), rank(rank) {}
  std::shared_ptr<Clique> clique;
  const int rank;
  int splits_made = 0;
  std::atomic<bool> aborted{false};
  std::atomic<int> async{ncclSuccess};
};

namespace {

// Per thread: the thread that got an error reads it (FromNccl).
std::string& LastError() {
  thread_local std::string last;
  return last;
}

ncclResult_t Fail(ncclResult_t res, const std::string& why) {
  LastError() = why;
  return res;
}

void Post(Comm* comm, int to, const void* buf, size_t bytes) {
  Clique& c = *comm->clique;
  Clique::Message m;
  m.bytes.assign(static_cast<const char*>(buf), static_cast<const char*>(buf) + bytes);
  m.ready = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(LateSeconds()));
  std::lock_guard<std::mutex> lock(c.mu);
  c.mail[{comm->rank, to}].push_back(std::move(m));
  c.cv.notify_all();
}

// Blocks the stream until `from`'s next message arrives, or `comm` is
// aborted; a hung receive waits for the abort only.
void Take(Comm* comm, int from, void* buf, size_t bytes, bool hang) {
  Clique& c = *comm->clique;
  std::unique_lock<std::mutex> lock(c.mu);
  auto& box = c.mail[{from, comm->rank}];
  for (;;) {
    if (comm->aborted) return;
    if (!hang && !box.empty() && box.front().ready <= Clock::now()) break;
    c.cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  Clique::Message m = std::move(box.front());
  box.pop_front();
  if (m.bytes.size() != bytes) {
    comm->async = ncclInvalidUsage;
    return;
  }
  std::memcpy(buf, m.bytes.data(), bytes);
}

size_t SizeOf(ncclDataType_t t) {
  switch (t) {
    case ncclFloat16:
      return 2;
    case ncclFloat32:
      return 4;
    case ncclFloat64:
      return 8;
    default:
      return 1;
  }
}

// Calls between ncclGroupStart and ncclGroupEnd, per thread.
struct Op {
  bool send;
  Comm* comm;
  void* buf;
  size_t bytes;
  int peer;
  cudaStream_t stream;
  bool hang;
};
thread_local int group_depth = 0;
thread_local std::vector<Op> group_ops;
thread_local int nccl_launches = 0;

// Sends first, so a ring of ranks that all send and receive in one group
// cannot deadlock.
void Launch(std::vector<Op> ops) {
  ++nccl_launches;
  std::map<cudaStream_t, std::vector<Op>> by_stream;
  for (Op& op : ops) by_stream[op.stream].push_back(op);
  for (auto& [stream, list] : by_stream) {
    stream->Enqueue([list = std::move(list)] {
      for (const Op& op : list) {
        if (op.send && !op.comm->aborted) Post(op.comm, op.peer, op.buf, op.bytes);
      }
      for (const Op& op : list) {
        if (!op.send) Take(op.comm, op.peer, op.buf, op.bytes, op.hang);
      }
    });
  }
}

ncclResult_t Issue(Op op) {
  if (op.comm == nullptr || op.peer < 0 || op.peer >= op.comm->clique->size) {
    return Fail(ncclInvalidArgument, "bad communicator or peer");
  }
  if (op.comm->aborted) return Fail(ncclInvalidUsage, "communicator was aborted");
  if (TakeFault(&Faults::fail_calls)) return Fail(ncclSystemError, "injected failure");
  if (!op.send) op.hang = TakeFault(&Faults::hang_recvs);
  if (group_depth > 0) {
    group_ops.push_back(op);
  } else {
    Launch({op});
  }
  return ncclSuccess;
}

thread_local int current_device = 0;

}  // namespace

int NcclLaunches() { return nccl_launches; }
}  // namespace jaxcomm::host_device

using namespace jaxcomm::host_device;

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    default:
      return "cudaErrorInvalidValue";
  }
}
const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaSuccess ? "no error" : "host device error";
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0) return cudaErrorInvalidValue;
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                            cudaStream_t stream) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  stream->Enqueue([=] { std::memcpy(dst, src, bytes); });
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  ++jaxcomm::host_device::host_waits;
  stream->Synchronize();
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  *stream = new Stream();
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
  if (stream == nullptr || event == nullptr) return cudaErrorInvalidValue;
  if (event->progress == nullptr) return cudaSuccess;
  // The recorded point is taken now: a later record of the same event does
  // not move this wait, and the event may be destroyed before it runs.
  std::shared_ptr<Progress> progress = event->progress;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(progress->mu);
    ticket = event->ticket;
  }
  stream->Enqueue([progress = std::move(progress), ticket] {
    std::unique_lock<std::mutex> lock(progress->mu);
    progress->cv.wait(lock, [&] { return progress->completed >= ticket; });
  });
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream) {
  if (ptr == nullptr || stream == nullptr) return cudaErrorInvalidValue;
  *ptr = bytes == 0 ? nullptr : std::malloc(bytes);
  return bytes == 0 || *ptr != nullptr ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  stream->Enqueue([ptr] { std::free(ptr); });
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  *event = new Event();
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr || stream == nullptr) return cudaErrorInvalidValue;
  event->progress = stream->progress();
  std::lock_guard<std::mutex> lock(event->progress->mu);
  event->ticket = event->progress->issued;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (event->progress == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> lock(event->progress->mu);
  return event->progress->completed >= event->ticket ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclInProgress:
      return "operation in progress";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclSystemError:
      return "unhandled system error";
    default:
      return "internal error";
  }
}
const char* ncclGetLastError(ncclComm_t) { return LastError().c_str(); }
ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

namespace {
std::mutex ids_mu;
std::map<std::string, std::shared_ptr<Clique>> cliques_by_id;
std::atomic<uint64_t> next_id{1};
}  // namespace

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0, sizeof(id->internal));
  const uint64_t n = next_id++;
  std::memcpy(id->internal, &n, sizeof(n));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t*) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return Fail(ncclInvalidArgument, "bad rank");
  std::shared_ptr<Clique> clique;
  {
    std::lock_guard<std::mutex> lock(ids_mu);
    auto& slot = cliques_by_id[std::string(id.internal, sizeof(id.internal))];
    if (!slot) slot = std::make_shared<Clique>(nranks);
    clique = slot;
  }
  if (clique->size != nranks) return Fail(ncclInvalidUsage, "ranks disagree on the size");
  *comm = new Comm(clique, rank);
  return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t*) {
  Clique& c = *comm->clique;
  const int round = comm->splits_made++;
  std::unique_lock<std::mutex> lock(c.mu);
  Clique::SplitRound& r = c.splits[round];
  if (r.votes.empty()) r.votes.assign(c.size, {NCCL_SPLIT_NOCOLOR, 0});
  r.votes[comm->rank] = {color, key};
  if (++r.arrived == c.size) {
    std::map<int, int> sizes;
    for (const auto& v : r.votes) {
      if (v.first != NCCL_SPLIT_NOCOLOR) ++sizes[v.first];
    }
    for (const auto& [col, n] : sizes) r.children[col] = std::make_shared<Clique>(n);
    c.cv.notify_all();
  }
  c.cv.wait(lock, [&] { return r.arrived == c.size || comm->aborted; });
  if (comm->aborted) return Fail(ncclInvalidUsage, "communicator was aborted");
  *out = nullptr;
  if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  // New rank: position by (key, old rank) among the ranks of this color.
  int new_rank = 0;
  for (int q = 0; q < c.size; ++q) {
    const auto& v = r.votes[q];
    if (v.first == color && (v.second < key || (v.second == key && q < comm->rank))) ++new_rank;
  }
  *out = new Comm(r.children[color], new_rank);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  // Not freed: work still queued on a stream may name it.
  comm->aborted = true;
  std::lock_guard<std::mutex> lock(comm->clique->mu);
  comm->clique->cv.notify_all();
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async) {
  if (TakeFault(&Faults::in_progress_polls)) {
    *async = ncclInProgress;
    return ncclSuccess;
  }
  *async = static_cast<ncclResult_t>(comm->async.load());
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
  *rank = comm->rank;
  return ncclSuccess;
}
ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
  *count = comm->clique->size;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return Fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--group_depth == 0) Launch(std::exchange(group_ops, {}));
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return Issue({true, comm, const_cast<void*>(buf), count * SizeOf(type), peer, stream, false});
}
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return Issue({false, comm, buf, count * SizeOf(type), peer, stream, false});
}

// Every rank sends its block to every other rank and places what it
// receives at the sender's rank; the own block is copied first, so an
// in-place call (send == recv + rank * count) reads it before anything moves.
ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  if (comm->aborted) return Fail(ncclInvalidUsage, "communicator was aborted");
  if (TakeFault(&Faults::fail_calls)) return Fail(ncclSystemError, "injected failure");
  const bool hang = TakeFault(&Faults::hang_recvs);
  ++nccl_launches;
  stream->Enqueue([=] {
    const size_t bytes = count * SizeOf(type);
    const int size = comm->clique->size;
    std::vector<char> mine(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
    for (int q = 0; q < size; ++q) {
      if (q != comm->rank) Post(comm, q, mine.data(), bytes);
    }
    std::memcpy(static_cast<char*>(recv) + comm->rank * bytes, mine.data(), bytes);
    for (int q = 0; q < size; ++q) {
      if (q != comm->rank) Take(comm, q, static_cast<char*>(recv) + q * bytes, bytes, hang);
    }
  });
  return ncclSuccess;
}

// Every rank sends its input to every other rank and adds what it receives
// in rank order, so every rank gets the same bits.
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t, ncclComm_t comm, cudaStream_t stream) {
  if (type != ncclFloat32 && type != ncclFloat64) {
    return Fail(ncclInvalidArgument, "host ncclAllReduce adds float32 and float64 only");
  }
  if (comm->aborted) return Fail(ncclInvalidUsage, "communicator was aborted");
  if (TakeFault(&Faults::fail_calls)) return Fail(ncclSystemError, "injected failure");
  const bool hang = TakeFault(&Faults::hang_recvs);
  ++nccl_launches;
  stream->Enqueue([=] {
    const size_t bytes = count * SizeOf(type);
    const int size = comm->clique->size;
    for (int q = 0; q < size; ++q) {
      if (q != comm->rank) Post(comm, q, send, bytes);
    }
    std::vector<std::vector<char>> parts(size, std::vector<char>(bytes));
    std::memcpy(parts[comm->rank].data(), send, bytes);
    for (int q = 0; q < size; ++q) {
      if (q != comm->rank) Take(comm, q, parts[q].data(), bytes, hang);
    }
    if (comm->aborted) return;
    for (size_t i = 0; i < count; ++i) {
      if (type == ncclFloat32) {
        float s = 0;
        for (int q = 0; q < size; ++q) s += reinterpret_cast<const float*>(parts[q].data())[i];
        static_cast<float*>(recv)[i] = s;
      } else {
        double s = 0;
        for (int q = 0; q < size; ++q) s += reinterpret_cast<const double*>(parts[q].data())[i];
        static_cast<double*>(recv)[i] = s;
      }
    }
  });
  return ncclSuccess;
}
