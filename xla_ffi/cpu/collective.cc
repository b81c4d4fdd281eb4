#include "cpu/collective.h"

#include <mutex>
#include <numeric>

#include "cpu/stats.h"
#include "cpu/tcp_transport.h"

namespace jaxcomm::cpu {

uint64_t Rings::bytes_sent() const {
  uint64_t total = 0;
  for (const auto* t : {flat.get(), intra.get(), inter.get()}) {
    if (t) total += t->bytes_sent();
  }
  return total;
}

namespace {

// FNV-1a over the 8-byte words.
constexpr uint64_t kFnvOffset = 1469598103934665603ull;
uint64_t Mix(uint64_t h, int64_t v) {
  for (int b = 0; b < 8; ++b) {
    h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xffu;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

uint64_t Fingerprint(std::initializer_list<int64_t> values) {
  uint64_t h = kFnvOffset;
  for (int64_t v : values) h = Mix(h, v);
  return h;
}

uint64_t Fingerprint(OpTag op, std::initializer_list<int64_t> values) {
  uint64_t h = Mix(kFnvOffset, static_cast<int64_t>(op));
  for (int64_t v : values) h = Mix(h, v);
  return h;
}

Placement PlacementOf(int64_t op_id, const ReductionAttrs& reduction) {
  return {op_id, reduction.nranks, reduction.intra_size,
          static_cast<Algorithm>(reduction.algorithm)};
}

Status SiteOf(std::string op, const Caller& caller, const int32_t* coords,
              const Placement& placement, uint64_t fingerprint, CallSite* site) {
  const int64_t op_id = placement.op_id;
  const int32_t device = caller.device;
  *site = CallSite{std::move(op),
                   caller.run_id,
                   op_id,
                   device,
                   coords[0],
                   coords[1],
                   placement.nranks,
                   placement.intra_size,
                   placement.algorithm,
                   fingerprint};
  if (site->group >= 0 || TcpRankOf(op_id, device, &site->group, &site->rank)) {
    return Status::Ok();
  }
  return Status(Code::kInvalidArgument,
                "jaxcomm " + site->op + ": no [group, rank] registered for device " +
                    std::to_string(device) + " of this process at call site " +
                    std::to_string(op_id) +
                    ": the program's devices are not in the order the trace assumed "
                    "(jax.devices(), or the mesh of jax.set_mesh)");
}

bool CrossesProcesses(const CallSite& site) {
  return FindTcpEndpoint(site.op_id, site.group, site.rank) != nullptr;
}

namespace {

Status CheckSite(const CallSite& site) {
  if (site.nranks < 1) {
    return Status(Code::kInvalidArgument, "jaxcomm " + site.op + ": group size must be >= 1");
  }
  if (site.algorithm == Algorithm::kHierarchical) {
    const int L = site.intra_size;
    if (L < 1 || site.nranks % L != 0) {
      return Status(Code::kInvalidArgument,
                    "jaxcomm " + site.op + ": hierarchical needs the group size (" +
                        std::to_string(site.nranks) + ") to be a multiple of the ranks per node (" +
                        std::to_string(L) + ")");
    }
  }
  return Status::Ok();
}

Status JoinInProcess(const CallSite& site, Clock::time_point deadline, Rings* rings) {
  const CallSignature sig{site.op, site.fingerprint};
  std::unique_ptr<InProcessTransport> flat, intra, inter;
  if (site.algorithm == Algorithm::kHierarchical) {
    const int L = site.intra_size;
    const int node = site.rank / L, local = site.rank % L;
    JAXCOMM_RETURN_IF_ERROR(Connect({site.run_id, site.op_id, site.group, Ring::kIntra, node},
                                    local, L, site.device, sig, deadline, &intra));
    rings->intra = std::move(intra);
    JAXCOMM_RETURN_IF_ERROR(Connect({site.run_id, site.op_id, site.group, Ring::kInter, local},
                                    node, site.nranks / L, site.device, sig, deadline, &inter));
    rings->inter = std::move(inter);
  } else {
    JAXCOMM_RETURN_IF_ERROR(Connect({site.run_id, site.op_id, site.group, Ring::kFlat, 0},
                                    site.rank, site.nranks, site.device, sig, deadline, &flat));
    rings->flat = std::move(flat);
  }
  return Status::Ok();
}

// The rings over TCP: the same group ranks as in-process, each ring a list of
// them (a hierarchical node is L consecutive ranks).
void JoinTcp(const CallSite& site, TcpEndpoint& endpoint, Clock::time_point deadline,
             Rings* rings) {
  const std::string call = "jaxcomm " + site.op + " (op " + std::to_string(site.op_id) +
                           ", group " + std::to_string(site.group) + ", rank " +
                           std::to_string(site.rank) + " of " + std::to_string(site.nranks) + ")";
  const uint64_t call_number = endpoint.NextCall();
  auto ring = [&](std::vector<int> members, int index) {
    return std::make_unique<TcpTransport>(endpoint, std::move(members), index, call,
                                          site.fingerprint, call_number, deadline);
  };
  if (site.algorithm == Algorithm::kHierarchical) {
    const int L = site.intra_size, nodes = site.nranks / L;
    const int node = site.rank / L, local = site.rank % L;
    std::vector<int> intra(L), inter(nodes);
    for (int i = 0; i < L; ++i) intra[i] = node * L + i;
    for (int j = 0; j < nodes; ++j) inter[j] = j * L + local;
    rings->intra = ring(std::move(intra), local);
    rings->inter = ring(std::move(inter), node);
  } else {
    std::vector<int> all(site.nranks);
    std::iota(all.begin(), all.end(), 0);
    rings->flat = ring(std::move(all), site.rank);
  }
}

Status RunBody(const CallSite& site, Rings& rings, const std::function<Status(Rings&)>& body) {
  Status st = body(rings);
  if (!st.ok()) {
    // Wake peers still waiting on this rank instead of letting them time out.
    for (auto* t : {rings.flat.get(), rings.intra.get(), rings.inter.get()}) {
      if (t) t->Abort(st.message());
    }
    return st;
  }
  RecordCall(site.device, rings.bytes_sent());
  return Status::Ok();
}

}  // namespace

Status RunCollective(const CallSite& site, const std::function<Status(Rings&)>& body) {
  JAXCOMM_RETURN_IF_ERROR(CheckSite(site));
  const Clock::time_point deadline = Clock::now() + Timeout();
  if (auto endpoint = FindTcpEndpoint(site.op_id, site.group, site.rank)) {
    // One call at a time per endpoint: its connections carry one message stream.
    std::unique_lock<std::timed_mutex> lock(endpoint->call_mu(), std::defer_lock);
    if (!lock.try_lock_until(deadline)) {
      return Status(Code::kDeadlineExceeded,
                    "jaxcomm " + site.op + ": the previous call of this call site on rank " +
                        std::to_string(site.rank) + " did not finish in time");
    }
    if (!endpoint->failure().empty()) {
      return Status(Code::kAborted, "jaxcomm " + site.op +
                                        ": an earlier call of this call site failed, so its "
                                        "connections are closed: " +
                                        endpoint->failure());
    }
    if (endpoint->nranks() != site.nranks) {
      return Status(Code::kInvalidArgument,
                    "jaxcomm " + site.op + ": " + std::to_string(endpoint->nranks()) +
                        " peer addresses registered for a group of " + std::to_string(site.nranks));
    }
    Rings rings;
    JoinTcp(site, *endpoint, deadline, &rings);
    return RunBody(site, rings, body);
  }
  if (TcpSiteKnown(site.op_id)) {
    return Status(Code::kInvalidArgument,
                  "jaxcomm " + site.op + ": rank " + std::to_string(site.rank) + " of group " +
                      std::to_string(site.group) + " runs on device " +
                      std::to_string(site.device) +
                      " of this process, but no address was published for it here: the "
                      "program's devices are not in the order the trace assumed "
                      "(jax.devices(), or the mesh of jax.set_mesh)");
  }
  Rings rings;
  JAXCOMM_RETURN_IF_ERROR(JoinInProcess(site, deadline, &rings));
  return RunBody(site, rings, body);
}

}  // namespace jaxcomm::cpu
