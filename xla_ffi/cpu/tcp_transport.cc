#include "cpu/tcp_transport.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>
#include <tuple>

namespace jaxcomm::cpu {
namespace {

// What a connecting rank says first, so the listener knows who it is.
struct Hello {
  uint32_t magic;
  int32_t rank;
  int64_t op_id;
  int64_t group;
};
constexpr uint32_t kMagic = 0x4a58434d;  // "JXCM"
// A header with this fingerprint is a failing rank's last word: its reason,
// `bytes` long, instead of a message, so the peers report the first cause.
constexpr uint64_t kFailed = ~0ull;

// What precedes every message. The ranks of a call agree on all of it; a
// message left over from a call that failed halfway is caught by its numbers.
struct Header {
  uint64_t fingerprint;
  uint64_t bytes;
  uint64_t call;  // calls of this call site so far, on the sender
  uint64_t step;  // SendRecvs of this ring in this call so far
  bool operator==(const Header& o) const {
    return fingerprint == o.fingerprint && bytes == o.bytes && call == o.call && step == o.step;
  }
};

std::string Errno(int err) { return std::strerror(err); }

int MillisLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1 << 30));
}

std::string SecondsText(Clock::duration d) {
  return std::to_string(std::chrono::duration<double>(d).count()) + " s";
}

Status Error(Code code, const std::string& message) { return Status(code, message); }

// Resolves a numeric address (no DNS: Python publishes IP addresses).
Status Resolve(const TcpAddress& a, bool passive, addrinfo** out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  const std::string port = std::to_string(a.port);
  if (int rc = getaddrinfo(a.host.c_str(), port.c_str(), &hints, out); rc != 0) {
    return Error(Code::kInvalidArgument,
                 "jaxcomm: bad address " + a.host + ":" + port + ": " + gai_strerror(rc));
  }
  return Status::Ok();
}

// Moves all of `data` through the non-blocking `fd` in one direction before
// `deadline` (only for the small hello).
Status Full(int fd, char* data, size_t n, bool write, Clock::time_point deadline,
            const std::string& peer) {
  size_t done = 0;
  while (done < n) {
    pollfd p{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    if (poll(&p, 1, MillisLeft(deadline)) == 0) {
      return Error(Code::kDeadlineExceeded, "jaxcomm: no handshake with " + peer + " in time");
    }
    const ssize_t k =
        write ? send(fd, data + done, n - done, MSG_NOSIGNAL) : recv(fd, data + done, n - done, 0);
    if (k > 0) {
      done += static_cast<size_t>(k);
    } else if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      return Error(Code::kAborted, "jaxcomm: lost the connection to " + peer + " during the " +
                                       "handshake: " + (k == 0 ? "closed" : Errno(errno)));
    }
  }
  return Status::Ok();
}

void NoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// One attempt to connect to `a` before `deadline`; the socket or -1.
int TryConnect(const TcpAddress& a, Clock::time_point deadline, std::string* why) {
  addrinfo* info = nullptr;
  if (Status st = Resolve(a, false, &info); !st.ok()) {
    *why = st.message();
    return -1;
  }
  int fd = socket(info->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int err = fd < 0 ? errno : 0;
  if (fd >= 0 && connect(fd, info->ai_addr, info->ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      err = poll(&p, 1, std::min(MillisLeft(deadline), 1000)) == 1 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof(err);
      if (err == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    }
  }
  freeaddrinfo(info);
  if (err != 0) {
    *why = Errno(err);
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

struct Key {
  int64_t op_id, group;
  int rank;
  bool operator<(const Key& o) const {
    return std::tie(op_id, group, rank) < std::tie(o.op_id, o.group, o.rank);
  }
};

std::mutex registry_mu;
std::map<Key, std::shared_ptr<TcpEndpoint>>& Endpoints() {
  static auto* endpoints = new std::map<Key, std::shared_ptr<TcpEndpoint>>();
  return *endpoints;
}

}  // namespace

TcpEndpoint::TcpEndpoint(int64_t op_id, int64_t group, int rank, int listen_fd, TcpAddress self)
    : op_id_(op_id), group_(group), rank_(rank), listen_fd_(listen_fd), self_(std::move(self)) {}

TcpEndpoint::~TcpEndpoint() {
  CloseConnections();
  close(listen_fd_);
}

void TcpEndpoint::SetPeers(std::vector<TcpAddress> peers) {
  std::lock_guard<std::timed_mutex> lock(call_mu_);
  peers_ = std::move(peers);
}

std::string TcpEndpoint::Peer(int rank) const {
  std::string s = "rank " + std::to_string(rank);
  if (rank >= 0 && rank < nranks()) {
    s += " (" + peers_[rank].host + ":" + std::to_string(peers_[rank].port) + ")";
  }
  return s;
}

void TcpEndpoint::Fail(const std::string& reason) {
  if (failure_.empty()) failure_ = reason;
  for (const auto& [rank, fd] : to_) {
    if (mid_message_.count(rank)) continue;  // the peer would read it as data
    std::string notice(sizeof(Header), '\0');
    const Header header{kFailed, reason.size(), 0, 0};
    std::memcpy(notice.data(), &header, sizeof(header));
    notice += reason;
    (void)!send(fd, notice.data(), notice.size(), MSG_DONTWAIT | MSG_NOSIGNAL);  // best effort
  }
  CloseConnections();
}

void TcpEndpoint::SetMidMessage(int rank, bool midway) {
  if (midway) {
    mid_message_.insert(rank);
  } else {
    mid_message_.erase(rank);
  }
}

void TcpEndpoint::CloseConnections() {
  for (auto* m : {&to_, &from_}) {
    for (auto& [rank, fd] : *m) close(fd);
    m->clear();
  }
  mid_message_.clear();
}

Status TcpEndpoint::SocketTo(int rank, Clock::time_point deadline, int* fd) {
  if (auto it = to_.find(rank); it != to_.end()) {
    *fd = it->second;
    return Status::Ok();
  }
  std::string why;
  int s = -1;
  const Clock::time_point start = Clock::now();
  while ((s = TryConnect(peers_[rank], deadline, &why)) < 0) {
    if (Clock::now() >= deadline) {
      return Error(Code::kDeadlineExceeded, "could not connect to " + Peer(rank) + " within " +
                                                SecondsText(Clock::now() - start) + " (" + why +
                                                "); is its process running this job?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Hello hello{kMagic, rank_, op_id_, group_};
  if (Status st =
          Full(s, reinterpret_cast<char*>(&hello), sizeof(hello), true, deadline, Peer(rank));
      !st.ok()) {
    close(s);
    return st;
  }
  NoDelay(s);
  to_[rank] = *fd = s;
  return Status::Ok();
}

Status TcpEndpoint::AcceptOne(Clock::time_point deadline) {
  pollfd p{listen_fd_, POLLIN, 0};
  if (poll(&p, 1, MillisLeft(deadline)) == 0) return Error(Code::kDeadlineExceeded, "");
  const int s = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (s < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED || errno == EINTR) {
      return Status::Ok();  // the peer gave up already; wait for the next
    }
    return Error(Code::kInternal, "jaxcomm: cannot accept connections: " + Errno(errno));
  }
  Hello hello{};
  Status st =
      Full(s, reinterpret_cast<char*>(&hello), sizeof(hello), false, deadline, "a connecting peer");
  if (!st.ok() || hello.magic != kMagic || hello.op_id != op_id_ || hello.group != group_ ||
      hello.rank < 0 || hello.rank >= nranks()) {
    close(s);  // not one of this call site's ranks
    return Status::Ok();
  }
  NoDelay(s);
  // A peer that reconnects (after an error) replaces its old connection.
  if (auto it = from_.find(hello.rank); it != from_.end()) close(it->second);
  from_[hello.rank] = s;
  return Status::Ok();
}

Status TcpEndpoint::SocketFrom(int rank, Clock::time_point deadline, int* fd) {
  // Take every connection already waiting, so a peer's fresh one replaces a stale one.
  for (pollfd p{listen_fd_, POLLIN, 0}; poll(&p, 1, 0) == 1; p.revents = 0) {
    JAXCOMM_RETURN_IF_ERROR(AcceptOne(Clock::now() + std::chrono::seconds(1)));
  }
  const Clock::time_point start = Clock::now();
  while (from_.find(rank) == from_.end()) {
    Status st = AcceptOne(deadline);
    if (st.code() == Code::kDeadlineExceeded) {
      return Error(Code::kDeadlineExceeded, Peer(rank) + " did not connect within " +
                                                SecondsText(Clock::now() - start) +
                                                "; is its process running this collective?");
    }
    JAXCOMM_RETURN_IF_ERROR(st);
  }
  *fd = from_[rank];
  return Status::Ok();
}

Status TcpListen(int64_t op_id, int64_t group, int rank, const std::string& host, int* port) {
  std::lock_guard<std::mutex> lock(registry_mu);
  if (auto it = Endpoints().find({op_id, group, rank}); it != Endpoints().end()) {
    *port = it->second->self().port;
    return Status::Ok();
  }
  addrinfo* info = nullptr;
  JAXCOMM_RETURN_IF_ERROR(Resolve({host, 0}, true, &info));
  int fd = socket(info->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  bool ok = fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0 &&
            bind(fd, info->ai_addr, info->ai_addrlen) == 0 && listen(fd, 128) == 0;
  const int err = errno;
  freeaddrinfo(info);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ok = ok && getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0;
  if (!ok) {
    if (fd >= 0) close(fd);
    return Error(Code::kInternal, "jaxcomm: cannot listen on " + host + ": " + Errno(err));
  }
  *port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  Endpoints()[{op_id, group, rank}] =
      std::make_shared<TcpEndpoint>(op_id, group, rank, fd, TcpAddress{host, *port});
  return Status::Ok();
}

Status TcpSetPeers(int64_t op_id, int64_t group, const std::vector<TcpAddress>& peers) {
  std::lock_guard<std::mutex> lock(registry_mu);
  for (auto& [key, endpoint] : Endpoints()) {
    if (key.op_id == op_id && key.group == group) {
      if (key.rank >= static_cast<int>(peers.size())) {
        return Error(Code::kInvalidArgument, "jaxcomm: rank " + std::to_string(key.rank) +
                                                 " listens but the group has only " +
                                                 std::to_string(peers.size()) + " ranks");
      }
      endpoint->SetPeers(peers);
    }
  }
  return Status::Ok();
}

namespace {
std::map<std::pair<int64_t, int>, std::pair<int64_t, int>>& Ranks() {
  static auto* ranks = new std::map<std::pair<int64_t, int>, std::pair<int64_t, int>>();
  return *ranks;
}
}  // namespace

void TcpSetRank(int64_t op_id, int device, int64_t group, int rank) {
  std::lock_guard<std::mutex> lock(registry_mu);
  Ranks()[{op_id, device}] = {group, rank};
}

bool TcpRankOf(int64_t op_id, int device, int64_t* group, int32_t* rank) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Ranks().find({op_id, device});
  if (it == Ranks().end()) return false;
  *group = it->second.first;
  *rank = it->second.second;
  return true;
}

void TcpForget(int64_t op_id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  for (auto it = Endpoints().begin(); it != Endpoints().end();) {
    it = it->first.op_id == op_id ? Endpoints().erase(it) : std::next(it);
  }
  for (auto it = Ranks().begin(); it != Ranks().end();) {
    it = it->first.first == op_id ? Ranks().erase(it) : std::next(it);
  }
}

bool TcpSiteKnown(int64_t op_id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Endpoints().lower_bound({op_id, INT64_MIN, INT32_MIN});
  return it != Endpoints().end() && it->first.op_id == op_id;
}

std::shared_ptr<TcpEndpoint> FindTcpEndpoint(int64_t op_id, int64_t group, int rank) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Endpoints().find({op_id, group, rank});
  return it == Endpoints().end() ? nullptr : it->second;
}

namespace {

std::string Mismatch(const Header& got, const Header& want) {
  if (got.fingerprint != want.fingerprint || got.bytes != want.bytes) {
    return "other sizes, dtypes or options (" + std::to_string(got.bytes) + " bytes, " +
           std::to_string(want.bytes) + " expected)";
  }
  return "a message of call " + std::to_string(got.call) + " step " + std::to_string(got.step) +
         " at call " + std::to_string(want.call) + " step " + std::to_string(want.step) +
         " (an earlier call failed halfway)";
}

// One direction of one step: a header, then the payload.
struct Stream {
  int fd;
  char* header;
  char* payload;
  size_t payload_bytes;
  size_t done = 0;
  size_t total() const { return sizeof(Header) + payload_bytes; }
  bool finished() const { return done == total(); }
  char* at() const {
    return done < sizeof(Header) ? header + done : payload + (done - sizeof(Header));
  }
  size_t left_in_part() const {
    return done < sizeof(Header) ? sizeof(Header) - done : total() - done;
  }
};

// Received bytes are folded in (RingOps::Arrived) this many at a time: small
// enough that the adds and the next step's sends keep pace with the link,
// large enough that a call's fixed cost does not show.
constexpr size_t kSegment = 256 << 10;

}  // namespace

Status TcpTransport::SendRecv(const void* send, size_t send_bytes, int to, void* recv,
                              size_t recv_bytes, int from) {
  struct One final : RingOps {
    RingStep step;
    explicit One(RingStep step) : step(step) {}
    RingStep Step(int) override { return step; }
    void Arrived(int, size_t, size_t) override {}
  } one({send, send_bytes, recv, recv_bytes});
  return RingPhase(1, to, from, one);
}

Status TcpTransport::RingPhase(int steps, int to, int from, RingOps& ops) {
  if (steps <= 0) return Status::Ok();
  const int to_rank = members_[to], from_rank = members_[from];
  int out_fd = -1, in_fd = -1;
  Status st = endpoint_.SocketTo(to_rank, deadline_, &out_fd);
  if (st.ok()) st = endpoint_.SocketFrom(from_rank, deadline_, &in_fd);
  if (!st.ok()) return Status(st.code(), call_ + ": " + st.message());

  const uint64_t first_step = step_ + 1;  // every header carries its step's number
  step_ += steps;
  // The send cursor: step `sent_steps`, and the receive cursor: step
  // `got_steps`, of which `folded` payload bytes went through Arrived.
  int sent_steps = 0, got_steps = 0;
  size_t folded = 0;
  Header out_header{}, in_header{}, expected{};
  Stream out{out_fd, reinterpret_cast<char*>(&out_header), nullptr, 0};
  Stream in{in_fd, reinterpret_cast<char*>(&in_header), nullptr, 0};
  auto start_send = [&] {
    const RingStep b = ops.Step(sent_steps);
    out_header = {fingerprint_, b.send_bytes, call_number_, first_step + sent_steps};
    out.payload = const_cast<char*>(static_cast<const char*>(b.send));
    out.payload_bytes = b.send_bytes;
    out.done = 0;
  };
  auto start_recv = [&] {
    const RingStep b = ops.Step(got_steps);
    expected = {fingerprint_, b.recv_bytes, call_number_, first_step + got_steps};
    in.payload = static_cast<char*>(b.recv);
    in.payload_bytes = b.recv_bytes;
    in.done = 0;
    folded = 0;
  };
  start_send();
  start_recv();
  // How far the current send may go: step s+1's bytes wait for step s's to be folded in.
  auto sendable = [&]() -> size_t {
    if (sent_steps == 0 || got_steps >= sent_steps) return out.total();
    return sizeof(Header) + folded;  // got_steps == sent_steps - 1
  };
  struct MidMessage {  // records, however this returns, whether `out` stopped partway
    TcpEndpoint& endpoint;
    int rank;
    const Stream& out;
    ~MidMessage() { endpoint.SetMidMessage(rank, out.done != 0 && !out.finished()); }
  } mid_message{endpoint_, to_rank, out};
  const Clock::duration patience = Timeout();
  bool grace_used = false;
  while (sent_steps < steps || got_steps < steps) {
    const bool sending = sent_steps < steps && out.done < sendable();
    const bool receiving = got_steps < steps;
    pollfd p[2];
    int n = 0;
    if (sending) p[n++] = {out.fd, POLLOUT, 0};
    if (receiving) p[n++] = {in.fd, POLLIN, 0};
    const int ready = poll(p, n, MillisLeft(Clock::now() + patience));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0 && receiving && !grace_used) {
      // The peer that stalled may itself be timing out on its own upstream
      // just now: give its failure notice a moment to arrive, so the error
      // names the first cause rather than the nearest rank.
      grace_used = true;
      pollfd last{in.fd, POLLIN, 0};
      if (poll(&last, 1, 500) == 1) continue;
    }
    if (ready == 0) {
      const std::string what = receiving ? endpoint_.Peer(from_rank) + " sent nothing"
                                         : endpoint_.Peer(to_rank) + " took nothing";
      return Status(Code::kDeadlineExceeded,
                    call_ + ": " + what + " for " + SecondsText(patience) +
                        "; its process, or one before it on the ring, is not running this "
                        "collective");
    }
    if (sending) {
      const size_t part = std::min(out.left_in_part(), sendable() - out.done);
      const ssize_t k = ::send(out.fd, out.at(), part, MSG_NOSIGNAL);
      if (k > 0) {
        out.done += static_cast<size_t>(k);
      } else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return Status(Code::kAborted, call_ + ": lost the connection to " +
                                          endpoint_.Peer(to_rank) + ": " + Errno(errno));
      }
      if (out.finished()) {
        bytes_sent_ += out.payload_bytes;
        if (++sent_steps < steps) start_send();
      }
    }
    if (receiving) {
      const size_t before = in.done;
      const ssize_t k = ::recv(in.fd, in.at(), in.left_in_part(), 0);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        return Status(Code::kAborted,
                      call_ + ": " + endpoint_.Peer(from_rank) + " closed the connection (" +
                          (k == 0 ? std::string("it failed or stopped") : Errno(errno)) + ")");
      }
      if (k > 0) in.done += static_cast<size_t>(k);
      if (before < sizeof(Header) && in.done >= sizeof(Header) &&
          in_header.fingerprint == kFailed) {
        std::string reason(std::min<uint64_t>(in_header.bytes, 4096), '\0');
        (void)Full(in.fd, reason.data(), reason.size(), false,
                   Clock::now() + std::chrono::seconds(1), endpoint_.Peer(from_rank));
        return Status(Code::kAborted,
                      call_ + ": " + endpoint_.Peer(from_rank) + " failed: " + reason.c_str());
      }
      if (before < sizeof(Header) && in.done >= sizeof(Header) && !(in_header == expected)) {
        return Status(Code::kInvalidArgument, call_ + ": " + Mismatch(in_header, expected) +
                                                  " from " + endpoint_.Peer(from_rank));
      }
      // Fold in every whole segment, and the tail once the step is complete.
      const size_t got = in.done > sizeof(Header) ? in.done - sizeof(Header) : 0;
      while (got - folded >= kSegment || (in.finished() && folded < got)) {
        const size_t end = std::min(folded + kSegment, got);
        ops.Arrived(got_steps, folded, end);
        folded = end;
      }
      if (in.finished() && ++got_steps < steps) start_recv();
    }
  }
  return Status::Ok();
}

void TcpTransport::Abort(const std::string& reason) { endpoint_.Fail(reason); }

}  // namespace jaxcomm::cpu
