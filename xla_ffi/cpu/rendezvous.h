// Where the devices of one process meet. Each device runs its handler on its
// own thread; the threads of one collective find each other through a slot
// keyed by (RunId, op id, group, ring), exchange pointers, and copy.
//
// Every wait has a deadline: a rank that never arrives, or stops halfway,
// turns into a Status naming the missing ranks, never a hang. The slot is
// removed when the last rank that joined it leaves, so nothing outlives a call.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common/status.h"
#include "cpu/cpu_transport.h"

namespace jaxcomm::cpu {

using Clock = std::chrono::steady_clock;

// Which ring of a collective a slot serves: the flat ring, or for the
// hierarchical schedule one intra-node ring per node and one inter-node ring
// per local rank.
enum class Ring : int32_t { kFlat = 0, kIntra = 1, kInter = 2 };

struct SlotKey {
  int64_t run_id;
  int64_t op_id;
  int64_t group;  // index over the mesh axes that are not reduced
  Ring ring;
  int64_t ring_index;
  bool operator<(const SlotKey& o) const {
    return std::tie(run_id, op_id, group, ring, ring_index) <
           std::tie(o.run_id, o.op_id, o.group, o.ring, o.ring_index);
  }
};

// What a call promises about itself; ranks of one slot must agree on all of it.
struct CallSignature {
  std::string op;        // "allreduce", "reduce_scatter", ...
  uint64_t fingerprint;  // hash of sizes, dtypes, algorithm, mask count
};

// "jaxcomm allreduce (op 3, run 7, group 0, 8 ranks)": how errors name a call.
std::string DescribeCall(const std::string& op, const SlotKey& key, int nranks);
// "[2, 5]"
std::string RankList(const std::vector<int>& ranks);
// "ranks [2, 5] of 8 did not arrive within 60 s (devices [...] did); ..."
std::string NotArrived(const std::vector<int>& missing, int nranks, Clock::duration waited,
                       const std::vector<int>& present_devices);

class Slot {
 public:
  Slot(const SlotKey& key, int nranks, std::string op);

  const SlotKey& key() const { return key_; }
  int nranks() const { return nranks_; }

  // Wakes every waiter of this slot with `reason`; later waits fail at once.
  // Returns only when no peer is inside a PeerAccess any more, so a rank that
  // gives up can hand its buffers back to XLA: nobody reads or writes them.
  void Abort(const std::string& reason);
  bool aborted() const;
  Status AbortedStatus() const;

  // All ranks wait here; used by the direct schedule between its phases.
  Status Barrier(int rank, Clock::time_point deadline);

  // Pointers a rank exposes to its peers (direct schedule): one to read, one
  // to write.
  void Publish(int rank, const void* a, void* b);
  const void* PublishedA(int rank) const { return published_[rank].a; }
  void* PublishedB(int rank) const { return published_[rank].b; }

  // Brackets a rank's reads or writes of a peer's memory (see PeerAccess).
  bool BeginAccess();
  void EndAccess();

  // One paired exchange, see Transport::SendRecv.
  Status SendRecv(int rank, uint64_t step, const void* send, size_t send_bytes, void* recv,
                  size_t recv_bytes, int from, Clock::time_point deadline);

  std::string Describe() const;

 private:
  friend class Registry;

  struct Mailbox {
    std::mutex mu;
    std::condition_variable cv;
    const void* ptr = nullptr;
    size_t bytes = 0;
    uint64_t posted = 0;  // last step this rank offered data for
    uint64_t taken = 0;   // last step its receiver finished copying
  };
  struct Exposed {
    const void* a = nullptr;
    void* b = nullptr;
  };
  void WakeAll();

  const SlotKey key_;
  const int nranks_;
  const std::string op_;

  // Guarded by Registry::mu_.
  std::vector<char> joined_;
  std::vector<int> devices_;
  int num_joined_ = 0;
  int num_left_ = 0;
  bool has_fingerprint_ = false;
  uint64_t fingerprint_ = 0;
  int fingerprint_rank_ = -1;

  mutable std::mutex mu_;  // guards the fields below
  std::condition_variable cv_;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<uint64_t> barriers_passed_;
  int barrier_waiting_ = 0;
  uint64_t barrier_generation_ = 0;
  int accessing_ = 0;  // ranks inside a PeerAccess

  std::unique_ptr<Mailbox[]> boxes_;
  std::vector<Exposed> published_;
};

// While alive, the owning rank may touch the memory its peers published; it
// holds no lock, so the bracketed work must not wait for anything. ok() is
// false when the slot was already aborted: then touch nothing, the peer may be
// gone.
class PeerAccess {
 public:
  explicit PeerAccess(Slot& slot) : slot_(slot), ok_(slot.BeginAccess()) {}
  ~PeerAccess() {
    if (ok_) slot_.EndAccess();
  }
  PeerAccess(const PeerAccess&) = delete;
  PeerAccess& operator=(const PeerAccess&) = delete;
  bool ok() const { return ok_; }

 private:
  Slot& slot_;
  const bool ok_;
};

class Registry {
 public:
  static Registry& Get();

  // Joins the slot for `key` as `rank` and waits until all `nranks` ranks have
  // joined. On error, *slot may still be set and the caller must Leave it.
  Status Join(const SlotKey& key, int rank, int nranks, int device, const CallSignature& sig,
              Clock::time_point deadline, std::shared_ptr<Slot>* slot);
  void Leave(const std::shared_ptr<Slot>& slot);

  size_t live_slots();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<SlotKey, std::shared_ptr<Slot>> slots_;
};

// A joined slot seen as a Transport for one rank; leaves the slot when destroyed.
class InProcessTransport final : public CpuTransport {
 public:
  InProcessTransport(std::shared_ptr<Slot> slot, int rank, Clock::time_point deadline)
      : slot_(std::move(slot)), rank_(rank), deadline_(deadline) {}
  ~InProcessTransport() override;
  InProcessTransport(const InProcessTransport&) = delete;
  InProcessTransport& operator=(const InProcessTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return slot_->nranks(); }
  Status SendRecv(const void* send, size_t send_bytes, int to, void* recv, size_t recv_bytes,
                  int from) override;
  void Abort(const std::string& reason) override { slot_->Abort(reason); }

  Slot& slot() { return *slot_; }
  Clock::time_point deadline() const { return deadline_; }
  void CountSent(uint64_t bytes) { bytes_sent_ += bytes; }

 private:
  std::shared_ptr<Slot> slot_;
  int rank_;
  Clock::time_point deadline_;
  uint64_t step_ = 0;
};

// Joins a slot and wraps it; `*out` is left empty on error.
Status Connect(const SlotKey& key, int rank, int nranks, int device, const CallSignature& sig,
               Clock::time_point deadline, std::unique_ptr<InProcessTransport>* out);

// Seconds a rank waits for its peers before failing (default 60).
double TimeoutSeconds();
void SetTimeoutSeconds(double seconds);
// The same, as a Clock duration: a call's deadline is its start plus this.
Clock::duration Timeout();

}  // namespace jaxcomm::cpu
