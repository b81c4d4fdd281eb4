// The parts of a CPU collective call that do not depend on which collective
// it is: decoding the rank, joining the rings, mapping dtypes and errors.
// The handlers (allreduce.cc, reduce_scatter.cc, all_gather.cc) and the
// pybind11 test harness all go through RunCollective.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "algorithm/schedule.h"
#include "common/algorithm_code.h"
#include "common/codes.h"
#include "common/ffi_bindings.h"
#include "cpu/cpu_transport.h"
#include "cpu/rendezvous.h"

namespace jaxcomm::cpu {

struct CallSite {
  std::string op;  // for messages: "allreduce", ...
  int64_t run_id;  // same on every device of one execution
  int64_t op_id;   // same on every device for one call site
  int32_t device;  // for stats and messages
  int64_t group;   // index over the mesh axes not reduced
  int32_t rank;    // position on the reduced axes
  int32_t nranks;
  int32_t intra_size;  // hierarchical only: ranks per node
  Algorithm algorithm;
  uint64_t fingerprint;  // everything the ranks must agree on
};

// The connected rings of one call: `flat` for ring/direct, `intra` and
// `inter` for hierarchical; in-process rendezvous slots, or TCP when the call
// site has peers in other processes (cpu/tcp_transport.h). Leaving happens
// when this is destroyed.
struct Rings {
  std::unique_ptr<CpuTransport> flat, intra, inter;
  uint64_t bytes_sent() const;
};

// Joins the rings `site` needs, runs `body`, records stats. Every rank runs
// this; a failure on one rank aborts its rings so the others fail fast too.
Status RunCollective(const CallSite& site, const std::function<Status(Rings&)>& body);

// Whether `site` reaches its peers over TCP (registered from Python when the
// job has several processes); then shared memory (direct) is not an option.
bool CrossesProcesses(const CallSite& site);

uint64_t Fingerprint(std::initializer_list<int64_t> values);
// What the ranks of one call must agree on: `op`, then `values`.
uint64_t Fingerprint(OpTag op, std::initializer_list<int64_t> values);

// Who calls a handler: XLA's RunId and DeviceOrdinal contexts, bound as one
// (.Ctx<Caller>(), cpu/handlers.h).
struct Caller {
  int64_t run_id;
  int32_t device;
};

// Where a call runs, as its attributes say: the call site, how many ranks and
// the schedule (reduce_scatter and all_gather: a flat ring).
struct Placement {
  int64_t op_id;
  int32_t nranks;
  int32_t intra_size = 1;
  Algorithm algorithm = Algorithm::kRing;
};

// The placement of a reduction's attributes at call site `op_id`.
Placement PlacementOf(int64_t op_id, const ReductionAttrs& reduction);

// The site of one handler call, its [group, rank] from the coords operand
// or, where that group is negative (across processes), from what Python
// registered for this device at trace time.
Status SiteOf(std::string op, const Caller& caller, const int32_t* coords,
              const Placement& placement, uint64_t fingerprint, CallSite* site);

}  // namespace jaxcomm::cpu

// .Ctx<Caller>(): the two contexts every CPU collective handler reads.
namespace xla::ffi {
template <>
struct CtxDecoding<jaxcomm::cpu::Caller> {
  using Type = jaxcomm::cpu::Caller;

  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    auto run_id = CtxDecoding<RunId>::Decode(api, ctx, diagnostic);
    auto device = CtxDecoding<DeviceOrdinal>::Decode(api, ctx, diagnostic);
    if (!run_id || !device) return std::nullopt;
    return Type{run_id->run_id, *device};
  }
};
}  // namespace xla::ffi
