// Collectives across processes: the CPU schedules over TCP.
//
// Every device-rank of a call site (op id, group) that runs in several
// processes listens on a socket of its own, opened at trace time on the
// address the job's collectives use; Python publishes every rank's address
// through the jax.distributed key-value store and registers them here before
// the first call (jaxcomm/collectives/_peers.py). A rank connects to the peers
// it sends to and accepts the peers it receives from, on first use, and keeps
// the connections for later calls. Ranks of one process talk over TCP too
// (loopback), so every pair of ranks is reached the same way.
//
// A ring phase streams (RingPhase): what step s+1 forwards goes out segment by
// segment as step s's bytes arrive and are added, so neither the link nor the
// adds wait for a whole chunk.
//
// Both halves of a SendRecv run at once (non-blocking sockets and poll), so
// two ranks that send to each other never wait for one another. Every wait is
// bounded by the collective timeout: a peer that never connects, stops
// sending or goes away is an error that names it, never a hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cpu/cpu_transport.h"
#include "cpu/rendezvous.h"

namespace jaxcomm::cpu {

struct TcpAddress {
  std::string host;  // an IP address
  int port;
};

// One device-rank of one call site: its listening socket, every rank's
// address, and the connections made so far. One call uses it at a time.
class TcpEndpoint {
 public:
  TcpEndpoint(int64_t op_id, int64_t group, int rank, int listen_fd, TcpAddress self);
  ~TcpEndpoint();
  TcpEndpoint(const TcpEndpoint&) = delete;
  TcpEndpoint& operator=(const TcpEndpoint&) = delete;

  int rank() const { return rank_; }
  const TcpAddress& self() const { return self_; }
  void SetPeers(std::vector<TcpAddress> peers);
  int nranks() const { return static_cast<int>(peers_.size()); }
  // "rank 2 (10.0.0.3:41234)"
  std::string Peer(int rank) const;

  // A socket to send to `rank` / to receive from `rank`, made on first use.
  Status SocketTo(int rank, Clock::time_point deadline, int* fd);
  Status SocketFrom(int rank, Clock::time_point deadline, int* fd);
  // Closes every connection after an error, so the peers see it at once. The
  // ranks no longer agree on where their message streams stand, so later
  // calls of this call site fail at once with `reason`.
  void Fail(const std::string& reason);
  // Whether the last message to `rank` stopped partway (then Fail sends no notice).
  void SetMidMessage(int rank, bool midway);
  const std::string& failure() const { return failure_; }

  std::timed_mutex& call_mu() { return call_mu_; }
  // Numbers the calls of this endpoint (under call_mu): 1, 2, ...
  uint64_t NextCall() { return ++calls_; }

 private:
  Status AcceptOne(Clock::time_point deadline);
  void CloseConnections();

  const int64_t op_id_, group_;
  const int rank_;
  const int listen_fd_;
  const TcpAddress self_;
  std::vector<TcpAddress> peers_;
  std::map<int, int> to_, from_;  // peer rank -> socket
  std::set<int> mid_message_;     // peers whose last message stopped partway
  std::timed_mutex call_mu_;
  uint64_t calls_ = 0;
  std::string failure_;
};

// Opens the listening socket of (op_id, group, rank) on `host`, on a port the
// system picks, and returns that port.
Status TcpListen(int64_t op_id, int64_t group, int rank, const std::string& host, int* port);
// Every rank's address for (op_id, group), in rank order.
Status TcpSetPeers(int64_t op_id, int64_t group, const std::vector<TcpAddress>& peers);
// Which [group, rank] device `device` (its ordinal in this process) holds at
// call site `op_id`. Across processes the handlers take it from here rather
// than from an operand: XLA's CPU runtime starts a custom call whose operands
// are computed in the program only after the independent work it was ready
// beside, so an operand-free call is what lets the exchange overlap compute.
void TcpSetRank(int64_t op_id, int device, int64_t group, int rank);
bool TcpRankOf(int64_t op_id, int device, int64_t* group, int32_t* rank);
// Closes the sockets of call site `op_id` (a test's cleanup).
void TcpForget(int64_t op_id);
// Whether some rank of call site `op_id` listens in this process.
bool TcpSiteKnown(int64_t op_id);
// The endpoint of this rank when it has peers over TCP, else null (the call
// stays in this process).
std::shared_ptr<TcpEndpoint> FindTcpEndpoint(int64_t op_id, int64_t group, int rank);

// A ring over an endpoint: `members` are the group ranks of the ring in ring
// order, this rank is members[index].
class TcpTransport final : public CpuTransport {
 public:
  TcpTransport(TcpEndpoint& endpoint, std::vector<int> members, int index, std::string call,
               uint64_t fingerprint, uint64_t call_number, Clock::time_point deadline)
      : endpoint_(endpoint),
        members_(std::move(members)),
        index_(index),
        call_(std::move(call)),
        fingerprint_(fingerprint),
        call_number_(call_number),
        deadline_(deadline) {}

  int rank() const override { return index_; }
  int size() const override { return static_cast<int>(members_.size()); }
  Status SendRecv(const void* send, size_t send_bytes, int to, void* recv, size_t recv_bytes,
                  int from) override;
  // Streams the steps: one header and payload after another on each socket,
  // step s+1's bytes sent as soon as Arrived(s) covered them (see Transport).
  Status RingPhase(int steps, int to, int from, RingOps& ops) override;
  void Abort(const std::string& reason) override;

 private:
  TcpEndpoint& endpoint_;
  const std::vector<int> members_;
  const int index_;
  const std::string call_;  // for messages
  const uint64_t fingerprint_;
  const uint64_t call_number_;        // which call of the site this is, counted per endpoint
  const Clock::time_point deadline_;  // for connecting; transfers get the timeout per wait
  uint64_t step_ = 0;                 // steps so far in this call, in every header
};

}  // namespace jaxcomm::cpu
