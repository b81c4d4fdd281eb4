// The CUDA collective handlers on XLA's own communicators (cuda/xla_comms.h)
// on 8 host ranks: each call as XLA makes it (a Prepare frame, the requested
// cliques acquired, an Execute frame), against the fake collectives extension
// of fake_xla_collectives.h, compiled against the host device and loopback
// NCCL of xla_ffi/host_device/ (JAXCOMM_HOST_DEVICE, JAXCOMM_XLA_COMMS).
// Every result is checked against a sum computed here, and every Prepare
// against the groups written out here; faults come from the loopback NCCL.
#include "cuda/xla_comms.h"

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "common/algorithm_code.h"
#include "common/codes.h"
#include "common/dtype.h"
#include "cuda/handlers.h"
#include "fake_xla_collectives.h"
#include "fake_xla_ffi.h"
#include "host_device/nccl.h"

namespace {

using fake_xla::Attr;
using fake_xla::Buf;
using fake_xla::CallHandler;
using fake_xla::CliqueKey;
using fake_xla::CliqueRequest;
using fake_xla::DeviceGroups;
using fake_xla::HostContext;
using fake_xla::RankOrder;
using jaxcomm::Algorithm;
using jaxcomm::DType;
namespace cuda = jaxcomm::cuda;
namespace host = jaxcomm::host_device;

constexpr int kRanks = 8;
constexpr int32_t kSameWire = -1;  // wire_dtype: the input's dtype
constexpr int32_t kBF16Wire = static_cast<int32_t>(DType::kBF16);

// XLA's cliques, for the whole program: a later call over the same groups
// gets the same communicators.
fake_xla::Cliques xla_cliques;

// Small integers: every partial sum is exact in every wire type, so each
// rank's output must equal the reference exactly. `t` is the host rank
// (device first_id + t).
float Value(int t, int64_t i) { return static_cast<float>(static_cast<int>((t * 7 + i) % 13) - 6); }

// The sum of element i over the group that holds `device`.
float GroupSum(const DeviceGroups& groups, int64_t first_id, int64_t device, int64_t i) {
  for (const auto& g : groups) {
    if (std::find(g.begin(), g.end(), device) == g.end()) continue;
    float sum = 0;
    for (int64_t member : g) sum += Value(static_cast<int>(member - first_id), i);
    return sum;
  }
  return -12345.0f;  // not in any group: matches no result
}

// The device's [group, rank]: its group's index and its position there.
void Coords(const DeviceGroups& groups, int64_t device, int32_t coords[2]) {
  coords[0] = coords[1] = -1;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto it = std::find(groups[g].begin(), groups[g].end(), device);
    if (it == groups[g].end()) continue;
    coords[0] = static_cast<int32_t>(g);
    coords[1] = static_cast<int32_t>(it - groups[g].begin());
  }
}

// The "groups" attribute: every group's ids, group after group.
std::vector<int64_t> Flat(const DeviceGroups& groups) {
  std::vector<int64_t> ids;
  for (const auto& g : groups) ids.insert(ids.end(), g.begin(), g.end());
  return ids;
}

// What one device's call came to.
struct Invocation {
  std::string error;                    // the first error, "" if none
  std::vector<CliqueRequest> requests;  // what Prepare asked for
  std::vector<CliqueKey> cliques;       // acquired for the call
  std::vector<ncclComm_t> comms;        // this device's communicator of each
  int execute_waits = 0;                // host waits for the stream in Execute
};

// XLA running one custom call on one device: the Prepare stage (which XLA
// gives no stream and no device ordinal), then the cliques it requested
// acquired, then the Execute stage with the same operands and attributes.
Invocation Invoke(XLA_FFI_Handler* execute, HostContext& hc, int64_t device, RankOrder order,
                  const std::vector<XLA_FFI_Buffer>& args, const std::vector<XLA_FFI_Buffer>& rets,
                  const std::vector<Attr>& attrs) {
  fake_xla::CallCollectives xla(xla_cliques, device, order);
  HostContext prepare;
  prepare.device = -1;
  prepare.extensions = xla.extension();
  Invocation inv;
  inv.error = CallHandler(cuda::PrepareXlaComms, prepare, args, rets, attrs,
                          XLA_FFI_ExecutionStage_PREPARE);
  if (inv.error.empty()) inv.error = xla.Acquire();
  hc.extensions = xla.extension();
  if (inv.error.empty()) {
    const int waits = host::HostWaits();
    inv.error = CallHandler(execute, hc, args, rets, attrs);
    inv.execute_waits = host::HostWaits() - waits;
  }
  inv.requests = xla.requests();
  inv.cliques = xla.cliques();
  for (const CliqueKey& key : inv.cliques) inv.comms.push_back(xla.comm(key));
  hc.extensions = nullptr;
  return inv;
}

// One device's operands of a run: alive until its stream drains.
struct Operands {
  std::vector<float> x, y, shard;
  int32_t coords[2] = {-1, -1};
  std::unique_ptr<bool[]> mask;
};

// One run on 8 devices, first_id + t on host thread t with its own stream,
// as XLA runs one device per thread; `body` makes device t's handler calls.
// If any call failed, the run's cliques are aborted (XLA's part, played
// here by the fake), which ends the work the other devices queued on them;
// then the streams drain.
template <typename Body>
std::vector<std::vector<Invocation>> RunOnDevices(int64_t first_id, const Body& body) {
  std::vector<HostContext> contexts(kRanks);
  std::vector<std::vector<Invocation>> calls(kRanks);
  std::vector<std::thread> threads;
  for (int t = 0; t < kRanks; ++t) {
    contexts[t].stream = host::NewStream();
    contexts[t].device = static_cast<int>(first_id + t);
    threads.emplace_back([&, t] { calls[t] = body(t, contexts[t]); });
  }
  for (auto& thread : threads) thread.join();
  std::vector<CliqueKey> used;
  bool failed = false;
  for (const auto& device_calls : calls) {
    for (const Invocation& inv : device_calls) {
      failed |= !inv.error.empty();
      used.insert(used.end(), inv.cliques.begin(), inv.cliques.end());
    }
  }
  if (failed) xla_cliques.Abort(used);
  for (HostContext& hc : contexts) {
    cudaStreamSynchronize(hc.stream);
    host::DeleteStream(hc.stream);
  }
  return calls;
}

struct AllReduceCall {
  DeviceGroups groups;
  int64_t first_id = 0;
  Algorithm algorithm = Algorithm::kRing;
  int32_t intra_size = 1;
  int32_t wire_dtype = kSameWire;
  int64_t n = 1000;
  std::vector<int> mask = {};  // chunk mask; empty: every element
  int64_t chunk_size = 0, max_chunks = 0;
  RankOrder order = RankOrder::kGroupPosition;
  jaxcomm::Unselected unselected = jaxcomm::Unselected::kLocal;
};

struct Outcome {
  std::vector<Invocation> calls;  // per device (the last call of each)
  std::vector<std::vector<float>> out = std::vector<std::vector<float>>(kRanks);
};

Outcome RunAllReduce(const AllReduceCall& c) {
  std::vector<int64_t> ids = Flat(c.groups);
  std::vector<Operands> ops(kRanks);
  auto calls = RunOnDevices(c.first_id, [&](int t, HostContext& hc) {
    const int64_t device = c.first_id + t;
    Operands& op = ops[t];
    Coords(c.groups, device, op.coords);
    op.x.resize(c.n);
    for (int64_t i = 0; i < c.n; ++i) op.x[i] = Value(t, i);
    op.y.assign(c.n, -1000.0f);
    const int64_t nchunks = static_cast<int64_t>(c.mask.size());
    op.mask.reset(new bool[std::max<int64_t>(nchunks, 1)]);
    for (int64_t k = 0; k < nchunks; ++k) op.mask[k] = c.mask[k] != 0;
    int64_t x_dims[1] = {c.n}, coords_dims[1] = {2}, mask_dims[1] = {nchunks};
    int32_t algorithm = static_cast<int32_t>(c.algorithm), intra_size = c.intra_size,
            wire_dtype = c.wire_dtype;
    int32_t nranks = static_cast<int32_t>(c.groups[0].size());
    int64_t chunk_size = c.chunk_size, max_chunks = c.max_chunks;
    int32_t unselected = static_cast<int32_t>(c.unselected);
    double one = 1.0;
    return std::vector<Invocation>{
        Invoke(cuda::AllReduceCudaXlaComms, hc, device, c.order,
               {Buf(XLA_FFI_DataType_F32, op.x.data(), x_dims),
                Buf(XLA_FFI_DataType_S32, op.coords, coords_dims),
                Buf(XLA_FFI_DataType_PRED, op.mask.get(), mask_dims)},
               {Buf(XLA_FFI_DataType_F32, op.y.data(), x_dims)},
               {{"algorithm", XLA_FFI_DataType_S32, &algorithm},
                {"chunk_size", XLA_FFI_DataType_S64, &chunk_size},
                {"groups", XLA_FFI_DataType_S64, ids.data(), static_cast<int64_t>(ids.size())},
                {"intra_size", XLA_FFI_DataType_S32, &intra_size},
                {"max_chunks", XLA_FFI_DataType_S64, &max_chunks},
                {"nranks", XLA_FFI_DataType_S32, &nranks},
                {"postscale", XLA_FFI_DataType_F64, &one},
                {"prescale", XLA_FFI_DataType_F64, &one},
                {"unselected", XLA_FFI_DataType_S32, &unselected},
                {"wire_dtype", XLA_FFI_DataType_S32, &wire_dtype}})};
  });
  Outcome o;
  for (int t = 0; t < kRanks; ++t) {
    o.calls.push_back(calls[t].back());
    o.out[t] = std::move(ops[t].y);
  }
  return o;
}

void Fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(print_mu);
  std::cout << what << "\n";
  ++failures;
}

// Every device's result: the sum over its group of the selected chunks (the
// first `max_chunks` selected ones where that is set), its own values (or
// zeros, Unselected::kZero) elsewhere; everything summed without a mask.
void CheckSums(const std::string& what, const AllReduceCall& c, const Outcome& o) {
  for (int t = 0; t < kRanks; ++t) {
    const int64_t device = c.first_id + t;
    if (!o.calls[t].error.empty()) {
      Fail(what + ": device " + std::to_string(device) + ": " + o.calls[t].error);
      continue;
    }
    int64_t wrong = 0;
    for (int64_t i = 0; i < c.n; ++i) {
      bool summed = c.mask.empty();
      if (!summed) {
        const int64_t chunk = i / c.chunk_size;
        int64_t selected_before = 0;
        for (int64_t k = 0; k < chunk; ++k) selected_before += c.mask[k] != 0;
        summed = c.mask[chunk] != 0 && (c.max_chunks == 0 || selected_before < c.max_chunks);
      }
      const float rest = c.unselected == jaxcomm::Unselected::kZero ? 0.0f : Value(t, i);
      const float want = summed ? GroupSum(c.groups, c.first_id, device, i) : rest;
      wrong += o.out[t][i] != want;
    }
    if (wrong != 0) {
      Fail(what + ": device " + std::to_string(device) + ": " + std::to_string(wrong) + " of " +
           std::to_string(c.n) + " wrong");
    }
  }
}

// Prepare asked XLA for exactly `want` (in any order), each by flattened
// ids and on XLA's own communication id, so the cliques are those XLA's
// collectives over the same devices use.
void CheckRequests(const std::string& what, const std::vector<Invocation>& calls,
                   std::vector<DeviceGroups> want) {
  std::sort(want.begin(), want.end());
  for (size_t t = 0; t < calls.size(); ++t) {
    std::vector<DeviceGroups> got;
    for (const CliqueRequest& r : calls[t].requests) {
      got.push_back(r.groups);
      if (r.mode != XLA_FFI_GROUP_FLATTENED_ID || r.communication_id != 0) {
        Fail(what + ": device " + std::to_string(t) + ": a request not by flattened ids on id 0");
      }
    }
    std::sort(got.begin(), got.end());
    if (got != want) {
      Fail(what + ": device " + std::to_string(t) + ": Prepare requested " +
           std::to_string(got.size()) + " cliques, not the " + std::to_string(want.size()) +
           " expected");
    }
  }
}

const DeviceGroups kFlat{{0, 1, 2, 3, 4, 5, 6, 7}};

// Ring, hierarchical with 2 and 4 ranks per node, and direct (ncclAllReduce
// for float32, the ring with a wire cast), over one group in id order: the
// sums, and the cliques Prepare asks for (hierarchical: the nodes, and the
// ranks of equal local index across them).
void CheckAlgorithms() {
  const DeviceGroups intra2{{0, 1}, {2, 3}, {4, 5}, {6, 7}}, inter2{{0, 2, 4, 6}, {1, 3, 5, 7}};
  const DeviceGroups intra4{{0, 1, 2, 3}, {4, 5, 6, 7}}, inter4{{0, 4}, {1, 5}, {2, 6}, {3, 7}};
  for (int64_t n : {int64_t{1000}, int64_t{3}}) {
    for (int32_t wire : {kSameWire, kBF16Wire}) {
      const std::string tag = " (n " + std::to_string(n) + ", wire " + std::to_string(wire) + ")";
      AllReduceCall ring{kFlat, 0, Algorithm::kRing, 1, wire, n};
      Outcome o = RunAllReduce(ring);
      CheckSums("ring" + tag, ring, o);
      CheckRequests("ring" + tag, o.calls, {kFlat});
      AllReduceCall hier2{kFlat, 0, Algorithm::kHierarchical, 2, wire, n};
      o = RunAllReduce(hier2);
      CheckSums("hierarchical L=2" + tag, hier2, o);
      CheckRequests("hierarchical L=2" + tag, o.calls, {kFlat, intra2, inter2});
      AllReduceCall hier4{kFlat, 0, Algorithm::kHierarchical, 4, wire, n};
      o = RunAllReduce(hier4);
      CheckSums("hierarchical L=4" + tag, hier4, o);
      CheckRequests("hierarchical L=4" + tag, o.calls, {kFlat, intra4, inter4});
      AllReduceCall direct{kFlat, 0, Algorithm::kDirect, 1, wire, n};
      o = RunAllReduce(direct);
      CheckSums("direct" + tag, direct, o);
      CheckRequests("direct" + tag, o.calls, {kFlat});
    }
  }
  // One node (a mesh axis of size 1 either way): the flat clique is asked
  // for twice, and the other level's cliques hold one device each.
  const DeviceGroups singles{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
  AllReduceCall one_per_node{kFlat, 0, Algorithm::kHierarchical, 1, kBF16Wire, 100};
  Outcome o = RunAllReduce(one_per_node);
  CheckSums("hierarchical L=1", one_per_node, o);
  CheckRequests("hierarchical L=1", o.calls, {kFlat, singles, kFlat});
  AllReduceCall one_node{kFlat, 0, Algorithm::kHierarchical, 8, kBF16Wire, 100};
  o = RunAllReduce(one_node);
  CheckSums("hierarchical L=8", one_node, o);
  CheckRequests("hierarchical L=8", o.calls, {kFlat, kFlat, singles});
}

// Groups in another order than device ids, and several groups: XLA picks
// each device's group and ranks it by its position there.
void CheckGroupLayouts() {
  // A reduction over (local, node): ranks interleave the nodes.
  const DeviceGroups shuffled{{0, 4, 1, 5, 2, 6, 3, 7}};
  AllReduceCall ring{shuffled};
  Outcome o = RunAllReduce(ring);
  CheckSums("ring, interleaved group", ring, o);
  AllReduceCall hier2{shuffled, 0, Algorithm::kHierarchical, 2, kBF16Wire};
  o = RunAllReduce(hier2);
  CheckSums("hierarchical L=2, interleaved group", hier2, o);
  CheckRequests("hierarchical L=2, interleaved group", o.calls,
                {shuffled, {{0, 4}, {1, 5}, {2, 6}, {3, 7}}, {{0, 1, 2, 3}, {4, 5, 6, 7}}});
  AllReduceCall hier4{shuffled, 0, Algorithm::kHierarchical, 4};
  o = RunAllReduce(hier4);
  CheckSums("hierarchical L=4, interleaved group", hier4, o);
  CheckRequests("hierarchical L=4, interleaved group", o.calls,
                {shuffled, {{0, 4, 1, 5}, {2, 6, 3, 7}}, {{0, 2}, {4, 6}, {1, 3}, {5, 7}}});

  const DeviceGroups reversed{{7, 6, 5, 4, 3, 2, 1, 0}};
  AllReduceCall backwards{reversed, 0, Algorithm::kRing, 1, kSameWire, 100};
  CheckSums("ring, group in reverse order", backwards, RunAllReduce(backwards));

  const DeviceGroups two{{0, 2, 4, 6}, {1, 3, 5, 7}};
  AllReduceCall ring_two{two, 0, Algorithm::kRing, 1, kBF16Wire, 100};
  o = RunAllReduce(ring_two);
  CheckSums("ring, two groups", ring_two, o);
  CheckRequests("ring, two groups", o.calls, {two});
  AllReduceCall hier_two{two, 0, Algorithm::kHierarchical, 2, kSameWire, 100};
  o = RunAllReduce(hier_two);
  CheckSums("hierarchical L=2, two groups", hier_two, o);
  CheckRequests("hierarchical L=2, two groups", o.calls,
                {two, {{0, 2}, {4, 6}, {1, 3}, {5, 7}}, {{0, 4}, {2, 6}, {1, 5}, {3, 7}}});
}

// The rank check reads the device's coords once per communicator: the
// first call on new cliques waits for the stream, later ones never do.
void CheckRankReadOnce() {
  const DeviceGroups group{{8, 9, 10, 11, 12, 13, 14, 15}};
  AllReduceCall call{group, 8, Algorithm::kRing, 1, kSameWire, 64};
  const Outcome first = RunAllReduce(call);
  const Outcome second = RunAllReduce(call);
  CheckSums("first call on new cliques", call, first);
  CheckSums("second call", call, second);
  for (int t = 0; t < kRanks; ++t) {
    CHECK(first.calls[t].execute_waits >= 1);
    CHECK(second.calls[t].execute_waits == 0);
    CHECK(first.calls[t].comms == second.calls[t].comms);
  }
}

// The allreduce handler with a chunk mask: only the selected chunks are
// summed, the first `max_chunks` of them where that is set; the others keep
// each device's values or are zeros.
void CheckMasked() {
  const std::vector<int> mask = {1, 0, 0, 1, 1, 0, 1};  // 7 chunks of 16, the last short
  for (int64_t max_chunks : {0, 2, 9}) {
    for (Algorithm algorithm : {Algorithm::kRing, Algorithm::kHierarchical}) {
      AllReduceCall c{kFlat, 0, algorithm, 2, kSameWire, 100, mask, 16, max_chunks};
      c.unselected = max_chunks == 2 ? jaxcomm::Unselected::kZero : jaxcomm::Unselected::kLocal;
      const std::string what = "masked, max_chunks " + std::to_string(max_chunks) + ", algorithm " +
                               std::to_string(static_cast<int>(algorithm)) + ", unselected " +
                               std::to_string(static_cast<int>(c.unselected));
      const Outcome o = RunAllReduce(c);
      CheckSums(what, c, o);
      for (int t = 0; t < kRanks; ++t) CHECK(o.calls[t].execute_waits == 0);
    }
  }
}

// reduce_scatter (bfloat16 wire), then all_gather of the shards, each a call
// of its own: every device ends up with its group's padded sum, and each
// call's Prepare asks for its groups only.
void CheckScatterGather(const DeviceGroups& groups) {
  constexpr int64_t n = 100;
  const int32_t nranks = static_cast<int32_t>(groups[0].size());
  const int64_t shard = (n + nranks - 1) / nranks;
  std::vector<int64_t> ids = Flat(groups);
  std::vector<Operands> ops(kRanks);
  auto calls = RunOnDevices(0, [&](int t, HostContext& hc) {
    Operands& op = ops[t];
    Coords(groups, t, op.coords);
    op.x.resize(n);
    for (int64_t i = 0; i < n; ++i) op.x[i] = Value(t, i);
    op.shard.assign(shard, -1000.0f);
    op.y.assign(shard * nranks, -1000.0f);
    int64_t x_dims[1] = {n}, shard_dims[1] = {shard}, y_dims[1] = {shard * nranks};
    int64_t coords_dims[1] = {2};
    int32_t rs_wire = kBF16Wire, ag_wire = kSameWire, ranks = nranks;
    double one = 1.0;
    const Attr groups_attr{"groups", XLA_FFI_DataType_S64, ids.data(),
                           static_cast<int64_t>(ids.size())};
    std::vector<Invocation> done;
    done.push_back(Invoke(cuda::ReduceScatterCudaXlaComms, hc, t, RankOrder::kGroupPosition,
                          {Buf(XLA_FFI_DataType_F32, op.x.data(), x_dims),
                           Buf(XLA_FFI_DataType_S32, op.coords, coords_dims)},
                          {Buf(XLA_FFI_DataType_F32, op.shard.data(), shard_dims)},
                          {groups_attr,
                           {"nranks", XLA_FFI_DataType_S32, &ranks},
                           {"postscale", XLA_FFI_DataType_F64, &one},
                           {"prescale", XLA_FFI_DataType_F64, &one},
                           {"wire_dtype", XLA_FFI_DataType_S32, &rs_wire}}));
    if (!done.back().error.empty()) return done;
    done.push_back(Invoke(cuda::AllGatherCudaXlaComms, hc, t, RankOrder::kGroupPosition,
                          {Buf(XLA_FFI_DataType_F32, op.shard.data(), shard_dims),
                           Buf(XLA_FFI_DataType_S32, op.coords, coords_dims)},
                          {Buf(XLA_FFI_DataType_F32, op.y.data(), y_dims)},
                          {groups_attr,
                           {"nranks", XLA_FFI_DataType_S32, &ranks},
                           {"wire_dtype", XLA_FFI_DataType_S32, &ag_wire}}));
    return done;
  });
  const std::string what =
      "reduce_scatter + all_gather, " + std::to_string(groups.size()) + " group(s)";
  for (int t = 0; t < kRanks; ++t) {
    CHECK(calls[t].size() == 2);
    for (const Invocation& inv : calls[t]) {
      if (!inv.error.empty()) Fail(what + ": device " + std::to_string(t) + ": " + inv.error);
    }
    CheckRequests(what, calls[t], {groups});
    int64_t wrong = 0;
    for (int64_t i = 0; i < shard * nranks; ++i) {
      wrong += ops[t].y[i] != (i < n ? GroupSum(groups, 0, t, i) : 0.0f);
    }
    if (wrong != 0)
      Fail(what + ": device " + std::to_string(t) + ": " + std::to_string(wrong) + " wrong");
  }
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// What goes wrong, and what each device is told.
void CheckFailures() {
  // A runtime whose clique ranks are not the devices' positions in their
  // group: every device's first call says so, before any NCCL call.
  {
    const DeviceGroups reversed{{23, 22, 21, 20, 19, 18, 17, 16}};
    AllReduceCall c{reversed, 16, Algorithm::kRing, 1, kSameWire, 64};
    c.order = RankOrder::kDeviceId;
    const Outcome o = RunAllReduce(c);
    for (int t = 0; t < kRanks; ++t) {
      const std::string want = "XLA's communicator gives this device rank " + std::to_string(t) +
                               " but it is rank " + std::to_string(7 - t) + " of its group";
      CHECK(Contains(o.calls[t].error, want));
    }
  }

  // Hierarchical with a node size that does not divide the group: Prepare
  // asks for the flat clique only, and Execute says why it cannot run.
  {
    const DeviceGroups group{{24, 25, 26, 27, 28, 29, 30, 31}};
    AllReduceCall c{group, 24, Algorithm::kHierarchical, 3, kSameWire, 64};
    const Outcome o = RunAllReduce(c);
    CheckRequests("hierarchical L=3", o.calls, {group});
    for (int t = 0; t < kRanks; ++t) {
      CHECK(Contains(o.calls[t].error,
                     "hierarchical needs the group size (8) to be a multiple of "
                     "the ranks per node (3)"));
    }
  }

  // Groups that leave devices out: XLA refuses those devices' requests, and
  // their Prepare says why.
  {
    const DeviceGroups half{{48, 49, 50, 51}};
    AllReduceCall c{half, 48, Algorithm::kRing, 1, kSameWire, 64};
    const Outcome o = RunAllReduce(c);
    for (int t = 4; t < kRanks; ++t) {
      CHECK(Contains(o.calls[t].error, "XLA's collectives extension refused the clique request"));
      CHECK(Contains(o.calls[t].error,
                     "device " + std::to_string(48 + t) + " is in none of the replica groups"));
    }
  }

  // Execute without a Prepare: XLA acquired nothing, and says so.
  {
    HostContext hc;
    hc.stream = host::NewStream();
    hc.device = 40;
    fake_xla::CallCollectives xla(xla_cliques, 40);
    hc.extensions = xla.extension();
    CHECK(xla.Acquire().empty());
    std::vector<int64_t> ids = {40, 41};
    float x[4] = {1, 2, 3, 4}, y[4] = {};
    int32_t coords[2] = {0, 0}, zero = 0, nranks = 2, wire_dtype = kSameWire;
    int64_t dims[1] = {4}, coords_dims[1] = {2}, no_chunks[1] = {0}, none = 0;
    bool mask[1] = {false};
    double one = 1.0;
    const std::string err = CallHandler(
        cuda::AllReduceCudaXlaComms, hc,
        {Buf(XLA_FFI_DataType_F32, x, dims), Buf(XLA_FFI_DataType_S32, coords, coords_dims),
         Buf(XLA_FFI_DataType_PRED, mask, no_chunks)},
        {Buf(XLA_FFI_DataType_F32, y, dims)},
        {{"algorithm", XLA_FFI_DataType_S32, &zero},
         {"chunk_size", XLA_FFI_DataType_S64, &none},
         {"groups", XLA_FFI_DataType_S64, ids.data(), 2},
         {"intra_size", XLA_FFI_DataType_S32, &zero},
         {"max_chunks", XLA_FFI_DataType_S64, &none},
         {"nranks", XLA_FFI_DataType_S32, &nranks},
         {"postscale", XLA_FFI_DataType_F64, &one},
         {"prescale", XLA_FFI_DataType_F64, &one},
         {"unselected", XLA_FFI_DataType_S32, &zero},
         {"wire_dtype", XLA_FFI_DataType_S32, &wire_dtype}});
    std::cout << "without Prepare: " << err << "\n";
    CHECK(Contains(err, "XLA's collectives extension gave no communicator"));
    CHECK(Contains(err, "no clique acquired for the group of device 40"));
    cudaStreamSynchronize(hc.stream);
    host::DeleteStream(hc.stream);
  }

  // A failed NCCL call comes back with NCCL's message from the device it
  // failed on; once the run's cliques are aborted, the next run, on new
  // communicators, sums right.
  {
    AllReduceCall c{kFlat, 0, Algorithm::kRing, 1, kSameWire, 64};
    const Outcome before = RunAllReduce(c);
    CheckSums("before the failure", c, before);
    host::InjectedFaults().fail_calls = 1;
    const Outcome o = RunAllReduce(c);
    host::ResetFaults();
    int failed = 0;
    for (int t = 0; t < kRanks; ++t) {
      if (o.calls[t].error.empty()) continue;
      ++failed;
      std::cout << "failed NCCL call: " << o.calls[t].error << "\n";
      CHECK(Contains(o.calls[t].error, "unhandled system error (injected failure)"));
    }
    CHECK(failed == 1);
    const Outcome after = RunAllReduce(c);
    CheckSums("after the failure", c, after);
    for (int t = 0; t < kRanks; ++t) {
      CHECK(!after.calls[t].comms.empty() && !before.calls[t].comms.empty());
      if (!after.calls[t].comms.empty() && !before.calls[t].comms.empty()) {
        CHECK(after.calls[t].comms[0] != before.calls[t].comms[0]);
      }
    }
  }
}

}  // namespace

int main() {
  fake_xla::InstallExtensions();
  CheckAlgorithms();
  CheckGroupLayouts();
  CheckRankReadOnce();
  CheckMasked();
  CheckScatterGather(kFlat);
  CheckScatterGather({{0, 2, 4, 6}, {1, 3, 5, 7}});

  // XLA may make its communicators non-blocking: a call that stays in
  // progress for a while is awaited, not failed.
  host::InjectedFaults().in_progress_polls = 200;
  AllReduceCall slow{kFlat, 0, Algorithm::kDirect};
  CheckSums("in progress", slow, RunAllReduce(slow));
  CHECK(host::InjectedFaults().in_progress_polls == 0);
  host::ResetFaults();

  CheckFailures();

  // Every scratch block went back to XLA, and every error the fake made.
  CHECK(fake_xla::memory.live.empty() && fake_xla::memory.bad_frees == 0);
  CHECK(fake_xla::errors_made == fake_xla::errors_destroyed);
  return Result();
}
