#include "cpu/rendezvous.h"

#include <atomic>
#include <cstring>
#include <sstream>

namespace jaxcomm::cpu {
namespace {

std::atomic<double> g_timeout_seconds{60.0};

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

std::string RankList(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  s << "]";
  return s.str();
}

std::string NotArrived(const std::vector<int>& missing, int nranks, Clock::duration waited,
                       const std::vector<int>& present_devices) {
  return "ranks " + RankList(missing) + " of " + std::to_string(nranks) +
         " did not arrive within " + std::to_string(Seconds(waited)) + " s (devices " +
         RankList(present_devices) +
         " did); is the collective under a condition that differs between devices, or are "
         "several steps in flight?";
}

std::string DescribeCall(const std::string& op, const SlotKey& key, int nranks) {
  std::ostringstream s;
  s << "jaxcomm " << op << " (op " << key.op_id << ", run " << key.run_id << ", group "
    << key.group;
  if (key.ring == Ring::kIntra) s << ", intra-node ring " << key.ring_index;
  if (key.ring == Ring::kInter) s << ", inter-node ring " << key.ring_index;
  s << ", " << nranks << " ranks)";
  return s.str();
}

double TimeoutSeconds() { return g_timeout_seconds.load(); }
Clock::duration Timeout() {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(TimeoutSeconds()));
}
void SetTimeoutSeconds(double seconds) { g_timeout_seconds.store(seconds); }

Slot::Slot(const SlotKey& key, int nranks, std::string op)
    : key_(key),
      nranks_(nranks),
      op_(std::move(op)),
      joined_(nranks, 0),
      devices_(nranks, -1),
      barriers_passed_(nranks, 0),
      boxes_(new Mailbox[nranks]),
      published_(nranks) {}

std::string Slot::Describe() const { return DescribeCall(op_, key_, nranks_); }

void Slot::WakeAll() {
  { std::lock_guard<std::mutex> l(mu_); }
  cv_.notify_all();
  for (int r = 0; r < nranks_; ++r) {
    {
      std::lock_guard<std::mutex> l(boxes_[r].mu);
    }
    boxes_[r].cv.notify_all();
  }
}

void Slot::Abort(const std::string& reason) {
  bool first = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!aborted_) {
      first = true;
      aborted_ = true;
      abort_reason_ = reason;
    }
  }
  if (first) WakeAll();
  // Peers already inside a PeerAccess finish their bounded copy loop; no new
  // one starts. Waiting here is what makes returning the buffers safe.
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return accessing_ == 0; });
}

bool Slot::BeginAccess() {
  std::lock_guard<std::mutex> l(mu_);
  if (aborted_) return false;
  ++accessing_;
  return true;
}

void Slot::EndAccess() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (--accessing_ > 0) return;
  }
  cv_.notify_all();
}

bool Slot::aborted() const {
  std::lock_guard<std::mutex> l(mu_);
  return aborted_;
}

Status Slot::AbortedStatus() const {
  std::lock_guard<std::mutex> l(mu_);
  return Status(Code::kAborted, abort_reason_);
}

Status Slot::Barrier(int rank, Clock::time_point deadline) {
  std::unique_lock<std::mutex> l(mu_);
  const uint64_t generation = barrier_generation_;
  barriers_passed_[rank]++;
  if (++barrier_waiting_ == nranks_) {
    barrier_waiting_ = 0;
    barrier_generation_++;
    l.unlock();
    cv_.notify_all();
    return Status::Ok();
  }
  const bool done =
      cv_.wait_until(l, deadline, [&] { return barrier_generation_ != generation || aborted_; });
  if (aborted_) return Status(Code::kAborted, abort_reason_);
  if (done) return Status::Ok();
  std::vector<int> missing;
  for (int r = 0; r < nranks_; ++r) {
    if (barriers_passed_[r] < barriers_passed_[rank]) missing.push_back(r);
  }
  l.unlock();
  const std::string msg = Describe() + ": ranks " + RankList(missing) +
                          " stopped making progress (barrier " +
                          std::to_string(barriers_passed_[rank]) + " not reached before the " +
                          std::to_string(TimeoutSeconds()) + " s deadline)";
  Abort(msg);
  return Status(Code::kDeadlineExceeded, msg);
}

void Slot::Publish(int rank, const void* a, void* b) {
  published_[rank].a = a;  // read by peers only after the next Barrier
  published_[rank].b = b;
}

Status Slot::SendRecv(int rank, uint64_t step, const void* send, size_t send_bytes, void* recv,
                      size_t recv_bytes, int from, Clock::time_point deadline) {
  Mailbox& mine = boxes_[rank];
  Mailbox& theirs = boxes_[from];
  {
    std::lock_guard<std::mutex> l(mine.mu);
    mine.ptr = send;
    mine.bytes = send_bytes;
    mine.posted = step;
  }
  mine.cv.notify_all();

  auto fail = [&](const std::string& what) {
    const std::string msg = Describe() + ": rank " + std::to_string(rank) + " waited " +
                            std::to_string(TimeoutSeconds()) + " s for " + what + " at step " +
                            std::to_string(step);
    Abort(msg);
    return Status(Code::kDeadlineExceeded, msg);
  };

  const void* src;
  {
    std::unique_lock<std::mutex> l(theirs.mu);
    if (!theirs.cv.wait_until(l, deadline, [&] { return theirs.posted >= step || aborted(); })) {
      l.unlock();
      return fail("rank " + std::to_string(from) + " to send");
    }
    if (aborted()) return AbortedStatus();
    if (theirs.bytes != recv_bytes) {
      const std::string msg = Describe() + ": rank " + std::to_string(from) + " sent " +
                              std::to_string(theirs.bytes) + " bytes but rank " +
                              std::to_string(rank) + " expected " + std::to_string(recv_bytes);
      l.unlock();
      Abort(msg);
      return Status(Code::kInvalidArgument, msg);
    }
    src = theirs.ptr;
  }
  {
    PeerAccess access(*this);  // the sender may give up meanwhile: it waits for this
    if (!access.ok()) return AbortedStatus();
    if (recv_bytes) std::memcpy(recv, src, recv_bytes);
  }
  {
    std::lock_guard<std::mutex> l(theirs.mu);
    theirs.taken = step;
  }
  theirs.cv.notify_all();

  // The receiver reads straight out of `send`: keep it alive until it is done.
  std::unique_lock<std::mutex> l(mine.mu);
  if (!mine.cv.wait_until(l, deadline, [&] { return mine.taken >= step || aborted(); })) {
    l.unlock();
    return fail("its receiver to copy");
  }
  if (aborted()) return AbortedStatus();
  return Status::Ok();
}

Registry& Registry::Get() {
  static Registry* registry = new Registry();  // never destroyed: threads may outlive exit
  return *registry;
}

size_t Registry::live_slots() {
  std::lock_guard<std::mutex> l(mu_);
  return slots_.size();
}

Status Registry::Join(const SlotKey& key, int rank, int nranks, int device,
                      const CallSignature& sig, Clock::time_point deadline,
                      std::shared_ptr<Slot>* out) {
  const Clock::time_point start = Clock::now();
  if (rank < 0 || rank >= nranks) {
    return Status(Code::kInvalidArgument, "jaxcomm " + sig.op + ": rank " + std::to_string(rank) +
                                              " is outside a group of " + std::to_string(nranks));
  }
  std::unique_lock<std::mutex> l(mu_);
  std::shared_ptr<Slot> slot;
  while (true) {
    auto it = slots_.find(key);
    if (it == slots_.end()) {
      it = slots_.emplace(key, std::make_shared<Slot>(key, nranks, sig.op)).first;
    }
    slot = it->second;
    if (slot->nranks_ != nranks) {
      const std::string msg = slot->Describe() + ": rank " + std::to_string(rank) +
                              " called it for a group of " + std::to_string(nranks);
      l.unlock();
      slot->Abort(msg);
      cv_.notify_all();
      return Status(Code::kInvalidArgument, msg);
    }
    if (!slot->joined_[rank]) break;
    // This rank already joined this key: the same op ran again (a loop) while
    // slower ranks still finish the last round. Wait for that round to drain.
    const bool drained = cv_.wait_until(l, deadline, [&] {
      auto j = slots_.find(key);
      return j == slots_.end() || j->second != slot;
    });
    if (!drained) {
      return Status(Code::kDeadlineExceeded,
                    slot->Describe() + ": rank " + std::to_string(rank) +
                        " called the op again before the previous round finished");
    }
  }
  *out = slot;
  slot->joined_[rank] = 1;
  slot->devices_[rank] = device;
  slot->num_joined_++;
  if (slot->aborted()) return slot->AbortedStatus();
  if (!slot->has_fingerprint_) {
    slot->has_fingerprint_ = true;
    slot->fingerprint_ = sig.fingerprint;
    slot->fingerprint_rank_ = rank;
  } else if (slot->fingerprint_ != sig.fingerprint) {
    const std::string msg =
        slot->Describe() + ": ranks " + std::to_string(slot->fingerprint_rank_) + " and " +
        std::to_string(rank) + " called it with different sizes, dtypes, options or chunk masks";
    l.unlock();
    slot->Abort(msg);
    cv_.notify_all();
    return Status(Code::kInvalidArgument, msg);
  }
  if (slot->num_joined_ == nranks) {
    l.unlock();
    cv_.notify_all();
    return Status::Ok();
  }
  const bool all =
      cv_.wait_until(l, deadline, [&] { return slot->num_joined_ == nranks || slot->aborted(); });
  if (slot->aborted()) return slot->AbortedStatus();
  if (all) return Status::Ok();
  std::vector<int> missing, present_devices;
  for (int r = 0; r < nranks; ++r) {
    if (!slot->joined_[r])
      missing.push_back(r);
    else
      present_devices.push_back(slot->devices_[r]);
  }
  const std::string msg =
      slot->Describe() + ": " + NotArrived(missing, nranks, Clock::now() - start, present_devices);
  l.unlock();
  slot->Abort(msg);
  cv_.notify_all();
  return Status(Code::kDeadlineExceeded, msg);
}

void Registry::Leave(const std::shared_ptr<Slot>& slot) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (++slot->num_left_ < slot->num_joined_) return;
    auto it = slots_.find(slot->key());
    if (it != slots_.end() && it->second == slot) slots_.erase(it);
  }
  cv_.notify_all();
}

InProcessTransport::~InProcessTransport() { Registry::Get().Leave(slot_); }

Status InProcessTransport::SendRecv(const void* send, size_t send_bytes, int to, void* recv,
                                    size_t recv_bytes, int from) {
  (void)to;  // the receiver pulls: `to` reads from this rank's mailbox
  JAXCOMM_RETURN_IF_ERROR(
      slot_->SendRecv(rank_, ++step_, send, send_bytes, recv, recv_bytes, from, deadline_));
  bytes_sent_ += send_bytes;
  return Status::Ok();
}

Status Connect(const SlotKey& key, int rank, int nranks, int device, const CallSignature& sig,
               Clock::time_point deadline, std::unique_ptr<InProcessTransport>* out) {
  std::shared_ptr<Slot> slot;
  Status st = Registry::Get().Join(key, rank, nranks, device, sig, deadline, &slot);
  if (!st.ok()) {
    if (slot) Registry::Get().Leave(slot);
    return st;
  }
  *out = std::make_unique<InProcessTransport>(std::move(slot), rank, deadline);
  return Status::Ok();
}

}  // namespace jaxcomm::cpu
