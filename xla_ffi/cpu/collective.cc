#include "cpu/collective.h"

#include "cpu/stats.h"

namespace jaxcomm::cpu {

uint64_t Rings::bytes_sent() const {
  uint64_t total = 0;
  for (const auto* t : {flat.get(), intra.get(), inter.get()}) {
    if (t) total += t->bytes_sent();
  }
  return total;
}

uint64_t Fingerprint(std::initializer_list<int64_t> values) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the 8-byte words
  for (int64_t v : values) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h;
}

Status RunCollective(const CallSite& site, const std::function<Status(Rings&)>& body) {
  if (site.nranks < 1) {
    return Status(Code::kInvalidArgument, "jaxcomm " + site.op + ": group size must be >= 1");
  }
  const Clock::time_point deadline = Clock::now() + Timeout();
  const CallSignature sig{site.op, site.fingerprint};
  Rings rings;
  if (site.algorithm == Algorithm::kHierarchical) {
    const int L = site.intra_size;
    if (L < 1 || site.nranks % L != 0) {
      return Status(Code::kInvalidArgument,
                    "jaxcomm " + site.op + ": hierarchical needs the group size (" +
                        std::to_string(site.nranks) + ") to be a multiple of the ranks per node (" +
                        std::to_string(L) + ")");
    }
    const int node = site.rank / L, local = site.rank % L;
    JAXCOMM_RETURN_IF_ERROR(Connect({site.run_id, site.op_id, site.group, Ring::kIntra, node},
                                    local, L, site.device, sig, deadline, &rings.intra));
    JAXCOMM_RETURN_IF_ERROR(Connect({site.run_id, site.op_id, site.group, Ring::kInter, local},
                                    node, site.nranks / L, site.device, sig, deadline,
                                    &rings.inter));
  } else {
    JAXCOMM_RETURN_IF_ERROR(Connect({site.run_id, site.op_id, site.group, Ring::kFlat, 0},
                                    site.rank, site.nranks, site.device, sig, deadline,
                                    &rings.flat));
  }
  Status st = body(rings);
  if (!st.ok()) {
    // Wake peers still waiting on this rank instead of letting them time out.
    for (auto* t : {rings.flat.get(), rings.intra.get(), rings.inter.get()}) {
      if (t) t->slot().Abort(st.message());
    }
    return st;
  }
  RecordCall(site.device, rings.bytes_sent());
  return Status::Ok();
}

}  // namespace jaxcomm::cpu
