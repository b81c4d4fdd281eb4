#include "cpu/direct.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/async.h"
#include "cpu/cpu_kernels.h"
#include "cpu/stats.h"

namespace jaxcomm::cpu {
namespace {

// Elements summed per pass: the partial sums stay in L1 while every rank's
// slice streams through once.
constexpr size_t kBlock = 4096;
// Elements a thread takes at a time from a call's shared work.
constexpr size_t kShare = 4 * kBlock;
// Below this many elements per worker a thread hand-off costs more than the
// memory traffic it shares.
constexpr size_t kMinElementsPerWorker = 32768;

const char* Offset(const void* p, size_t elems, DType t) {
  return static_cast<const char*>(p) + elems * SizeOf(t);
}
char* Offset(void* p, size_t elems, DType t) { return static_cast<char*>(p) + elems * SizeOf(t); }

// One call whose ranks are arriving.
struct Pending {
  explicit Pending(const DirectCall& c)
      : call(c), ranks(c.nranks), start(Clock::now()), deadline(start + Timeout()) {
    for (size_t size : call.parts) {
      starts.push_back(n);
      n += size;
    }
  }
  std::string Describe() const { return DescribeCall(call.sig.op, call.key, call.nranks); }

  DirectCall call;
  std::vector<size_t> starts;  // where each part begins in the call's elements
  size_t n = 0;                // elements per rank, over all parts
  std::vector<std::optional<DirectRank>> ranks;
  int arrived = 0;
  Clock::time_point start, deadline;
  std::optional<Status> failure;  // set: every rank, present or late, gets it
};

// Sums elements [begin, end) of part `part` over the ranks and writes them
// to every output. Each block is read from every rank before any output of
// it is written, so an output may be its rank's own input (an in-place
// allreduce).
void ReducePart(const Pending& p, size_t part, size_t begin, size_t end) {
  Kernels& k = CpuKernels::Get();
  const ReduceSpec& spec = p.call.spec;
  const DType input = spec.input, wire = spec.wire, acc = spec.acc();
  const int size = p.call.nranks;
  // Contributions are cast to the wire type block by block as they are read.
  const bool cast_in = wire != input || spec.prescale != 1.0;
  alignas(64) double sum_storage[kBlock];
  alignas(64) double wire_storage[kBlock];
  alignas(64) double result_storage[kBlock];
  void* sum = sum_storage;
  void* on_wire = wire_storage;
  // The block as every output receives it, in the input type.
  void* result = wire == input ? on_wire : result_storage;
  const size_t row = SizeOf(input);
  for (size_t at = begin; at < end; at += kBlock) {
    const size_t len = std::min(kBlock, end - at);
    for (int j = 0; j < size; ++j) {
      const void* from = Offset(p.ranks[j]->in[part], at, input);
      if (cast_in) {
        k.Convert(on_wire, wire, from, input, len, spec.prescale);
        from = on_wire;
      }
      if (j == 0) {
        k.Convert(sum, acc, from, wire, len, 1.0);
      } else {
        k.Accumulate(sum, acc, from, wire, len);
      }
    }
    // The reduced block travels in the wire type too: round it once, cast it
    // back once, then every output receives the same bytes.
    if (spec.saturate()) k.Saturate(sum, acc, wire, len);
    k.Convert(on_wire, wire, sum, acc, len, spec.postscale);
    if (result != on_wire) k.Convert(result, input, on_wire, wire, len, 1.0);
    for (int j = 0; j < size; ++j) {
      std::memcpy(Offset(p.ranks[j]->out[part], at, input), result, len * row);
    }
  }
}

// Elements [begin, end) of the call, counted over its parts one after another.
void ReduceRange(const Pending& p, size_t begin, size_t end) {
  const std::vector<size_t>& starts = p.starts;
  // The last part that starts at or before `begin` (empty parts are skipped).
  size_t part = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (size_t at = begin; at < end; ++part) {
    const size_t part_end = starts[part] + p.call.parts[part];
    if (part_end <= at) continue;
    const size_t stop = std::min(end, part_end);
    ReducePart(p, part, at - starts[part], stop - starts[part]);
    at = stop;
  }
}

using Done = std::function<void(const Status&)>;

// Completing a rank's future may run that device's next work on the
// completing thread (XLA continues inline), and that work can block in
// another collective that needs the other devices, this thread's own device
// included. So only `mine` (the rank whose handler runs on this thread, whose
// future XLA has not seen yet) completes here, or none; the others each
// complete on a worker of their own.
void CompleteAll(std::vector<Done> done, const Status& st, int mine) {
  for (size_t i = 0; i < done.size(); ++i) {
    if (static_cast<int>(i) != mine && done[i])
      RunOnWorker([d = std::move(done[i]), st] { d(st); });
  }
  if (mine >= 0 && mine < static_cast<int>(done.size()) && done[mine]) done[mine](st);
}

// `mine`: the rank whose handler thread this is, or -1 on a worker.
void Finish(const Pending& p, int mine) {
  const size_t n = p.n;
  const int size = p.call.nranks;
  for (int r = 0; r < size; ++r) {
    // Accounted as a ring would send: the other chunks once, its own N-1 times.
    const size_t own = ChunkRange(n, size, r).size();
    RecordCall(p.ranks[r]->device, (n - own + (size - 1) * own) * SizeOf(p.call.spec.wire));
  }
  std::vector<Done> done;
  for (int r = 0; r < size; ++r) done.push_back(p.ranks[r]->done);
  CompleteAll(std::move(done), Status::Ok(), mine);
}

// Every rank is here (`mine` arrived last, on this thread): share the
// elements between this thread and workers; whoever finishes last completes
// every rank.
void Reduce(std::shared_ptr<Pending> p, int mine) {
  const size_t n = p->n;
  if (p->call.nranks == 1) {
    const ReduceSpec& s = p->call.spec;
    for (size_t i = 0; i < p->call.parts.size(); ++i) {
      CpuKernels::Get().Convert(p->ranks[0]->out[i], s.input, p->ranks[0]->in[i], s.input,
                                p->call.parts[i], s.prescale * s.postscale);
    }
    return Finish(*p, mine);
  }
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t parts =
      std::clamp<size_t>(n / kMinElementsPerWorker, 1, std::min<size_t>(cores, p->call.nranks));
  // Work is handed out kShare elements at a time, so a worker that starts
  // late (a sleeping thread can take hundreds of microseconds to wake on a
  // busy machine) does less instead of finishing last.
  struct Share {
    std::atomic<size_t> next{0};
    std::atomic<size_t> left;
  };
  auto share = std::make_shared<Share>();
  share->left = parts;
  auto part = [p, share, n](int on) {
    for (size_t at; (at = share->next.fetch_add(kShare, std::memory_order_relaxed)) < n;) {
      ReduceRange(*p, at, std::min(n, at + kShare));
    }
    if (share->left.fetch_sub(1, std::memory_order_acq_rel) == 1) Finish(*p, on);
  };
  for (size_t i = 1; i < parts; ++i) RunOnWorker([part] { part(-1); });
  part(mine);
}

class DirectRendezvous {
 public:
  static DirectRendezvous& Get() {
    static auto* r = new DirectRendezvous();  // never destroyed: the watchdog outlives exit
    return *r;
  }

  void Arrive(const DirectCall& call, DirectRank me) {
    if (me.rank < 0 || me.rank >= call.nranks) {
      return me.done(Status(Code::kInvalidArgument,
                            "jaxcomm " + call.sig.op + ": rank " + std::to_string(me.rank) +
                                " is outside a group of " + std::to_string(call.nranks)));
    }
    if (me.in.size() != call.parts.size() || me.out.size() != call.parts.size()) {
      return me.done(Status(Code::kInvalidArgument,
                            "jaxcomm " + call.sig.op + ": rank " + std::to_string(me.rank) +
                                " gave " + std::to_string(me.in.size()) + " inputs and " +
                                std::to_string(me.out.size()) + " outputs for " +
                                std::to_string(call.parts.size()) + " parts"));
    }
    std::unique_lock<std::mutex> l(mu_);
    std::shared_ptr<Pending>& slot = slots_[call.key];
    if (!slot) {
      slot = std::make_shared<Pending>(call);
      StartWatchdog();
      cv_.notify_one();  // a new, possibly earlier, deadline
    }
    std::shared_ptr<Pending> p = slot;
    std::vector<Done> failed;
    if (p->ranks[me.rank] || p->call.nranks != call.nranks) {
      // Not a rank of this round: fail it alone, the round goes on.
      const std::string msg =
          p->Describe() + ": rank " + std::to_string(me.rank) +
          (p->ranks[me.rank] ? " arrived twice"
                             : " called it for a group of " + std::to_string(call.nranks));
      l.unlock();
      return me.done(Status(Code::kInvalidArgument, msg));
    }
    if (!p->failure && p->call.sig.fingerprint != call.sig.fingerprint) {
      p->failure = Status(Code::kInvalidArgument,
                          p->Describe() + ": ranks " + std::to_string(FirstRank(*p)) + " and " +
                              std::to_string(me.rank) +
                              " called it with different sizes, dtypes, options or chunk masks");
      failed = TakeWaiting(*p);
    }
    p->arrived++;
    if (p->failure) {
      // Late ranks of a failed round fail at once; the last one removes it.
      p->ranks[me.rank] = DirectRank{me.rank, me.device, {}, {}, nullptr};
      if (p->arrived == p->call.nranks) slots_.erase(call.key);
      const Status failure = *p->failure;
      l.unlock();
      failed.insert(failed.begin(), std::move(me.done));  // index 0: this thread's rank
      return CompleteAll(std::move(failed), failure, 0);
    }
    const int rank = me.rank;
    p->ranks[rank] = std::move(me);
    if (p->arrived < p->call.nranks) return;
    slots_.erase(call.key);
    l.unlock();
    Reduce(std::move(p), rank);
  }

  size_t live() {
    std::lock_guard<std::mutex> l(mu_);
    return slots_.size();
  }

 private:
  static int FirstRank(const Pending& p) {
    for (int r = 0; r < p.call.nranks; ++r) {
      if (p.ranks[r]) return r;
    }
    return -1;
  }

  // The callbacks of the ranks of `p` that wait for a completion, moved out.
  static std::vector<Done> TakeWaiting(Pending& p) {
    std::vector<Done> waiting;
    for (auto& r : p.ranks) {
      if (r && r->done) {
        waiting.push_back(std::move(r->done));
        r->done = nullptr;
      }
    }
    return waiting;
  }

  void StartWatchdog() {
    if (watching_) return;
    watching_ = true;
    std::thread([this] { Watch(); }).detach();
  }

  // Fails the ranks of every call whose deadline passed, naming the absent.
  void Watch() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      std::optional<Clock::time_point> next;
      for (const auto& [key, p] : slots_) {
        if (!next || p->deadline < *next) next = p->deadline;
      }
      if (!next) {
        cv_.wait(l);
        continue;
      }
      if (cv_.wait_until(l, *next) == std::cv_status::no_timeout) continue;
      const Clock::time_point now = Clock::now();
      std::vector<std::pair<std::vector<Done>, Status>> expired;
      for (auto it = slots_.begin(); it != slots_.end();) {
        Pending& p = *it->second;
        if (p.deadline > now) {
          ++it;
          continue;
        }
        std::vector<int> missing, devices;
        for (int r = 0; r < p.call.nranks; ++r) {
          if (p.ranks[r]) {
            devices.push_back(p.ranks[r]->device);
          } else {
            missing.push_back(r);
          }
        }
        Status st = p.failure
                        ? *p.failure
                        : Status(Code::kDeadlineExceeded,
                                 p.Describe() + ": " +
                                     NotArrived(missing, p.call.nranks, now - p.start, devices));
        expired.emplace_back(TakeWaiting(p), std::move(st));
        it = slots_.erase(it);
      }
      l.unlock();
      for (auto& [done, st] : expired) CompleteAll(std::move(done), st, -1);
      l.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;  // wakes the watchdog
  std::map<SlotKey, std::shared_ptr<Pending>> slots_;
  bool watching_ = false;
};

}  // namespace

void ArriveDirect(const DirectCall& call, DirectRank me) {
  DirectRendezvous::Get().Arrive(call, std::move(me));
}

size_t LiveDirectSlots() { return DirectRendezvous::Get().live(); }

}  // namespace jaxcomm::cpu
