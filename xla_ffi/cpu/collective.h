// The parts of a CPU collective call that do not depend on which collective
// it is: decoding the rank, joining the rings, mapping dtypes and errors.
// The handlers (allreduce.cc, reduce_scatter.cc, all_gather.cc) and the
// pybind11 test harness all go through RunCollective.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "algorithm/schedule.h"
#include "common/algorithm_code.h"
#include "common/codes.h"
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

// The site of one handler call, its [group, rank] from the coords operand
// or, where that group is negative (across processes), from what Python
// registered for this device at trace time.
Status SiteOf(std::string op, int64_t run_id, int64_t op_id, int32_t device, const int32_t* coords,
              int32_t nranks, int32_t intra_size, Algorithm algorithm, uint64_t fingerprint,
              CallSite* site);

}  // namespace jaxcomm::cpu
