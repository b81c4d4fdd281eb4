// The CUDA backend's host logic on 8 host ranks: the real communicator cache
// and rendezvous (cuda/communicators.cc), RunOnOwnComms and ReduceContiguous
// (cuda/collective.cc) and NcclTransport, compiled against the host device and
// loopback NCCL of xla_ffi/host_device/ (JAXCOMM_HOST_DEVICE). Every result is
// checked against a sum computed here; faults come from the loopback NCCL.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "common/algorithm_code.h"
#include "common/codes.h"
#include "cuda/collective.h"
#include "cuda/communicators.h"
#include "cuda/handlers.h"
#include "cuda/nccl_transport.h"
#include "cuda/scratch.h"
#include "fake_xla_ffi.h"
#include "host_device/nccl.h"

namespace {

using jaxcomm::Algorithm;
using jaxcomm::DType;
using jaxcomm::ReduceSpec;
using jaxcomm::Status;
namespace cuda = jaxcomm::cuda;
namespace host = jaxcomm::host_device;

// XLA's side of a handler call: tests/cuda_host/fake_xla_ffi.h.
using fake_xla::api;
using fake_xla::Attr;
using fake_xla::Buf;
using fake_xla::CallHandler;
using fake_xla::HostContext;

constexpr int kRanks = 8;

// Small integers: every partial sum is exact in every wire type, so each
// rank's output must equal the reference exactly.
float Value(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((rank * 7 + i) % 13) - 6);
}

struct Call {
  int64_t op_id;
  int first_device;  // ranks run on devices first_device + rank
  Algorithm algorithm;
  int intra_size = 1;
  DType wire = DType::kF32;
  size_t n = 1000;
  std::vector<int> absent = {};  // ranks that never call
  bool scatter_gather = false;   // reduce_scatter, then all_gather of the shards
};

// reduce_scatter and all_gather over the flat communicator, as the handlers
// issue them: every rank ends up with the padded sum.
Status ScatterGather(const cuda::CommSet& set, cuda::CudaKernels& k, cudaStream_t stream,
                     cuda::Scratch& scratch, const ReduceSpec& spec, const float* in, float* out,
                     size_t n) {
  const size_t shard = (n + set.size - 1) / set.size;
  void *rs, *mine, *ag;
  JAXCOMM_RETURN_IF_ERROR(
      scratch.Allocate(jaxcomm::ReduceScatterScratchBytes(n, spec, set.size), &rs));
  JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(shard * sizeof(float), &mine));
  JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(
      jaxcomm::AllGatherScratchBytes(shard, spec.input, spec.input, set.size), &ag));
  cuda::NcclTransport flat(set, set.flat, set.rank, set.size, stream);
  JAXCOMM_RETURN_IF_ERROR(jaxcomm::RingReduceScatter(flat, k, spec, in, mine, n, rs));
  return jaxcomm::RingAllGather(flat, k, spec.input, spec.input, mine, out, shard, ag);
}

struct Outcome {
  std::vector<Status> status = std::vector<Status>(kRanks);
  std::vector<std::vector<float>> out = std::vector<std::vector<float>>(kRanks);
  std::vector<ncclComm_t> flat = std::vector<ncclComm_t>(kRanks, nullptr);
};

// One handler call per rank, each on its own thread and stream, as XLA runs
// one device per thread; then the streams drain.
Outcome Run(const Call& call) {
  Outcome o;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    bool skip = false;
    for (int a : call.absent) skip |= a == r;
    if (skip) continue;
    threads.emplace_back([&, r] {
      cudaStream_t stream = host::NewStream();
      std::vector<float> in(call.n);
      for (size_t i = 0; i < call.n; ++i) in[i] = Value(r, i);
      const size_t padded = (call.n + kRanks - 1) / kRanks * kRanks;
      o.out[r].assign(call.scatter_gather ? padded : call.n, -1000.0f);
      const int32_t coords[2] = {0, r};
      ReduceSpec spec;
      spec.input = DType::kF32;
      spec.wire = call.wire;
      HostContext hc{stream, call.first_device + r};
      const xla::ffi::Context ctx(&api, reinterpret_cast<XLA_FFI_ExecutionContext*>(&hc));
      {
        cuda::Scratch scratch(ctx);
        o.status[r] =
            cuda::RunOnOwnComms(stream, call.first_device + r, coords, call.op_id, kRanks,
                                [&](const cuda::CommSet& set, cuda::CudaKernels& k) {
                                  o.flat[r] = set.flat;
                                  if (call.scatter_gather) {
                                    return ScatterGather(set, k, stream, scratch, spec, in.data(),
                                                         o.out[r].data(), call.n);
                                  }
                                  return cuda::ReduceContiguous(
                                      set, k, stream, scratch, call.algorithm, call.intra_size,
                                      spec, in.data(), o.out[r].data(), call.n);
                                });
      }
      cudaStreamSynchronize(stream);
      host::DeleteStream(stream);
    });
  }
  for (auto& t : threads) t.join();
  return o;
}

void CheckSums(const char* what, const Call& call, const Outcome& o) {
  for (int r = 0; r < kRanks; ++r) {
    if (!o.status[r].ok()) {
      std::lock_guard<std::mutex> lock(print_mu);
      std::cout << what << ": rank " << r << ": " << o.status[r].message() << "\n";
      ++failures;
      continue;
    }
    size_t wrong = 0;
    for (size_t i = 0; i < call.n; ++i) {
      float want = 0;
      for (int q = 0; q < kRanks; ++q) want += Value(q, i);
      wrong += o.out[r][i] != want;
    }
    if (wrong != 0) {
      std::lock_guard<std::mutex> lock(print_mu);
      std::cout << what << ": rank " << r << ": " << wrong << " of " << call.n << " wrong\n";
      ++failures;
    }
  }
}

struct AllReduceArgs {
  int64_t op_id;
  int32_t algorithm = 0, nranks = kRanks, intra_size = 1, wire_dtype = -1;
  double prescale = 1.0, postscale = 1.0;
  int64_t chunk_size = 0, max_chunks = 0;
  int32_t unselected = static_cast<int32_t>(jaxcomm::Unselected::kLocal);
};

std::string CallAllReduce(HostContext& hc, float* x, float* y, int64_t n, int32_t* coords,
                          bool* mask, int64_t nchunks, AllReduceArgs a) {
  int64_t x_dims[1] = {n}, coords_dims[1] = {2}, mask_dims[1] = {nchunks};
  return CallHandler(
      cuda::AllReduceCuda, hc,
      {Buf(XLA_FFI_DataType_F32, x, x_dims), Buf(XLA_FFI_DataType_S32, coords, coords_dims),
       Buf(XLA_FFI_DataType_PRED, mask, mask_dims)},
      {Buf(XLA_FFI_DataType_F32, y, x_dims)},
      {{"algorithm", XLA_FFI_DataType_S32, &a.algorithm},
       {"chunk_size", XLA_FFI_DataType_S64, &a.chunk_size},
       {"intra_size", XLA_FFI_DataType_S32, &a.intra_size},
       {"max_chunks", XLA_FFI_DataType_S64, &a.max_chunks},
       {"nranks", XLA_FFI_DataType_S32, &a.nranks},
       {"op_id", XLA_FFI_DataType_S64, &a.op_id},
       {"postscale", XLA_FFI_DataType_F64, &a.postscale},
       {"prescale", XLA_FFI_DataType_F64, &a.prescale},
       {"unselected", XLA_FFI_DataType_S32, &a.unselected},
       {"wire_dtype", XLA_FFI_DataType_S32, &a.wire_dtype}});
}

std::string CallReduceScatter(HostContext& hc, float* x, int64_t n, float* y, int64_t shard,
                              int32_t* coords, int64_t op_id, int32_t wire_dtype) {
  int64_t x_dims[1] = {n}, y_dims[1] = {shard}, coords_dims[1] = {2};
  int32_t nranks = kRanks;
  double scale = 1.0;
  return CallHandler(
      cuda::ReduceScatterCuda, hc,
      {Buf(XLA_FFI_DataType_F32, x, x_dims), Buf(XLA_FFI_DataType_S32, coords, coords_dims)},
      {Buf(XLA_FFI_DataType_F32, y, y_dims)},
      {{"nranks", XLA_FFI_DataType_S32, &nranks},
       {"op_id", XLA_FFI_DataType_S64, &op_id},
       {"postscale", XLA_FFI_DataType_F64, &scale},
       {"prescale", XLA_FFI_DataType_F64, &scale},
       {"wire_dtype", XLA_FFI_DataType_S32, &wire_dtype}});
}

std::string CallAllGather(HostContext& hc, float* x, int64_t m, float* y, int64_t out,
                          int32_t* coords, int64_t op_id) {
  int64_t x_dims[1] = {m}, y_dims[1] = {out}, coords_dims[1] = {2};
  int32_t nranks = kRanks, wire_dtype = -1;
  return CallHandler(
      cuda::AllGatherCuda, hc,
      {Buf(XLA_FFI_DataType_F32, x, x_dims), Buf(XLA_FFI_DataType_S32, coords, coords_dims)},
      {Buf(XLA_FFI_DataType_F32, y, y_dims)},
      {{"nranks", XLA_FFI_DataType_S32, &nranks},
       {"op_id", XLA_FFI_DataType_S64, &op_id},
       {"wire_dtype", XLA_FFI_DataType_S32, &wire_dtype}});
}

// The reduce_scatter handler (bfloat16 wire), then the all_gather handler on
// its shards, on 8 host ranks: every rank ends up with the padded sum.
void CheckScatterGatherHandlers(int64_t op_id) {
  constexpr int64_t n = 100, shard = (n + kRanks - 1) / kRanks;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      HostContext hc{host::NewStream(), 80 + r};
      std::vector<float> x(n), mine(shard, -1000.0f), y(shard * kRanks, -1000.0f);
      for (int64_t i = 0; i < n; ++i) x[i] = Value(r, i);
      int32_t coords[2] = {0, r};
      const std::string rs =
          CallReduceScatter(hc, x.data(), n, mine.data(), shard, coords, op_id, 2);
      const std::string ag =
          CallAllGather(hc, mine.data(), shard, y.data(), shard * kRanks, coords, op_id + 1);
      cudaStreamSynchronize(hc.stream);
      host::DeleteStream(hc.stream);
      CHECK(rs.empty() && ag.empty());
      int wrong = 0;
      for (int64_t i = 0; i < shard * kRanks; ++i) {
        float want = 0;
        for (int q = 0; q < kRanks && i < n; ++q) want += Value(q, i);
        wrong += y[i] != want;
      }
      CHECK(wrong == 0);
    });
  }
  for (auto& t : threads) t.join();
}

// The allreduce handler with a chunk mask on 8 host ranks: only the
// selected chunks are summed, the first `max_chunks` of them when that is
// set; the others keep each rank's own values, or are zeros when asked. Past the first call of a
// site (which reads the rank once), a masked call never waits for the
// device: the mask stays there.
void CheckMaskedHandler(int64_t op_id) {
  constexpr int64_t n = 100, chunk = 16, nchunks = (n + chunk - 1) / chunk;
  bool mask[nchunks] = {true, false, false, true, true, false, true};  // last chunk short
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      HostContext hc{host::NewStream(), 70 + r};
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) x[i] = Value(r, i);
      int32_t coords[2] = {0, r};
      // max_chunks 0 (all), 2 (chunks 0 and 3 only), 9 (more than there are).
      for (int call = 0; call < 6; ++call) {
        const int64_t max_chunks = std::vector<int64_t>{0, 2, 9}[call % 3];
        const auto unselected = call < 3 ? jaxcomm::Unselected::kLocal : jaxcomm::Unselected::kZero;
        std::vector<float> y(n, -1000.0f);
        AllReduceArgs a{op_id};
        a.chunk_size = chunk;
        a.max_chunks = max_chunks;
        a.unselected = static_cast<int32_t>(unselected);
        const int waits = host::HostWaits();
        const std::string err = CallAllReduce(hc, x.data(), y.data(), n, coords, mask, nchunks, a);
        const int waited = host::HostWaits() - waits;
        cudaStreamSynchronize(hc.stream);
        CHECK(err.empty());
        if (!err.empty()) std::cout << "masked handler: " << err << "\n";
        CHECK(max_chunks == 0 || waited == 0);
        int wrong = 0, reduced = 0;
        for (int64_t c = 0; c < nchunks; ++c) {
          const bool sum = mask[c] && (max_chunks == 0 || reduced < max_chunks);
          reduced += sum ? 1 : 0;
          for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) {
            float want = unselected == jaxcomm::Unselected::kZero ? 0.0f : x[i];
            if (sum) {
              want = 0;
              for (int q = 0; q < kRanks; ++q) want += Value(q, i);
            }
            wrong += y[i] != want;
          }
        }
        CHECK(wrong == 0);
      }
      host::DeleteStream(hc.stream);
    });
  }
  for (auto& t : threads) t.join();
}

// The handler's argument checks, with the messages the Python side and the
// CPU handlers share (common/ffi_contract.h); none of them reaches NCCL.
void CheckHandlerErrors(int64_t op_id) {
  HostContext hc{host::NewStream(), 90};
  float x[8] = {}, y[8] = {};
  int32_t coords[2] = {0, 0};
  bool mask[2] = {true, true};
  auto call = [&](AllReduceArgs a, int64_t nchunks) {
    return CallAllReduce(hc, x, y, 8, coords, mask, nchunks, a);
  };
  AllReduceArgs bad_algorithm{op_id};
  bad_algorithm.algorithm = 7;
  CHECK(call(bad_algorithm, 0).find("jaxcomm allreduce: unknown algorithm code 7") !=
        std::string::npos);
  AllReduceArgs bad_wire{op_id};
  bad_wire.wire_dtype = 9;
  CHECK(call(bad_wire, 0).find("jaxcomm allreduce: unknown wire dtype code 9") !=
        std::string::npos);
  AllReduceArgs no_chunk{op_id};
  CHECK(call(no_chunk, 2).find("jaxcomm allreduce: chunk_size <= 0") != std::string::npos);
  float small[4] = {};
  CHECK(CallReduceScatter(hc, x, 8, small, 4, coords, op_id, -1)
            .find("jaxcomm reduce_scatter: output must hold 1 elements") != std::string::npos);
  CHECK(CallAllGather(hc, x, 8, small, 4, coords, op_id)
            .find("jaxcomm all_gather: output must hold nranks * 8 elements") != std::string::npos);
  AllReduceArgs wrong_mask{op_id};
  wrong_mask.chunk_size = 2;
  CHECK(call(wrong_mask, 2).find("chunk mask has 2 entries but the input has 4 chunks") !=
        std::string::npos);
  AllReduceArgs negative_bound{op_id};
  negative_bound.chunk_size = 4;
  negative_bound.max_chunks = -1;
  CHECK(call(negative_bound, 2).find("jaxcomm allreduce: max_chunks < 0") != std::string::npos);
  AllReduceArgs bad_unselected{op_id};
  bad_unselected.unselected = 2;
  CHECK(call(bad_unselected, 0).find("jaxcomm allreduce: unknown unselected code 2") !=
        std::string::npos);
  host::DeleteStream(hc.stream);
}

bool Contains(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

}  // namespace

int main() {
  // Ring, hierarchical (both splits) and direct, several sizes and wires,
  // on devices 0..7.
  int64_t op = 1;
  for (size_t n : {size_t{1000}, size_t{3}, size_t{0}}) {
    for (DType wire : {DType::kF32, DType::kBF16, DType::kF16}) {
      Call ring{op++, 0, Algorithm::kRing};
      ring.n = n;
      ring.wire = wire;
      CheckSums("ring", ring, Run(ring));
      for (int L : {2, 4}) {
        Call hier{op++, 0, Algorithm::kHierarchical, L, wire, n};
        CheckSums("hierarchical", hier, Run(hier));
      }
      Call direct{op++, 0, Algorithm::kDirect, 1, wire, n};  // ncclAllReduce or the ring
      CheckSums("direct", direct, Run(direct));
      Call scatter_gather{op++, 0, Algorithm::kRing, 1, wire, n, {}, true};
      CheckSums("reduce_scatter + all_gather", scatter_gather, Run(scatter_gather));
    }
  }

  // The cache: another call site over the same devices gets the same
  // communicators; a call site over other devices gets new ones.
  const Outcome a = Run({op++, 0, Algorithm::kRing});
  const Outcome b = Run({op++, 0, Algorithm::kRing});
  const Outcome c = Run({op++, 10, Algorithm::kRing});
  for (int r = 0; r < kRanks; ++r) {
    CHECK(a.flat[r] != nullptr && a.flat[r] == b.flat[r]);
    CHECK(c.flat[r] != nullptr && c.flat[r] != a.flat[r]);
  }

  // Non-blocking communicators: calls that stay in progress for a while are
  // awaited, not failed.
  host::InjectedFaults().in_progress_polls = 200;
  Call slow{op++, 0, Algorithm::kHierarchical, 2};
  CheckSums("in progress", slow, Run(slow));
  CHECK(host::InjectedFaults().in_progress_polls == 0);
  host::ResetFaults();

  cuda::SetTimeoutSeconds(0.5);
  // A rank that never arrives at the first call: the others name it.
  {
    const Outcome o = Run({op++, 20, Algorithm::kRing, 1, DType::kF32, 16, {5}});
    for (int r = 0; r < kRanks; ++r) {
      if (r == 5) continue;
      CHECK(!o.status[r].ok() && Contains(o.status[r], "waiting for ranks [5] of group 0"));
    }
  }

  // A failed NCCL call comes back with NCCL's message and its last error.
  {
    host::InjectedFaults().fail_calls = 1;
    const Outcome o = Run({op++, 30, Algorithm::kRing, 1, DType::kF32, 64});
    host::ResetFaults();
    int failed = 0;
    for (int r = 0; r < kRanks; ++r) {
      if (o.status[r].ok()) continue;
      ++failed;
      CHECK(Contains(o.status[r], "unhandled system error (injected failure)"));
    }
    CHECK(failed == 1);
  }

  // A receive that never completes: every handler returns (the work is
  // queued), the watchdog aborts the communicators once the timeout passes,
  // the streams drain, and every later call on them fails with the reason.
  {
    host::InjectedFaults().hang_recvs = 1;
    const Outcome hung = Run({op++, 40, Algorithm::kRing, 1, DType::kF32, 64});
    host::ResetFaults();
    for (int r = 0; r < kRanks; ++r) CHECK(hung.status[r].ok());
    const Outcome after = Run({op++, 40, Algorithm::kRing, 1, DType::kF32, 64});
    for (int r = 0; r < kRanks; ++r) {
      CHECK(!after.status[r].ok() && Contains(after.status[r], "did not finish within"));
    }
    // Devices 0..7 are untouched by it.
    Call fine{op++, 0, Algorithm::kRing};
    CheckSums("after an abort elsewhere", fine, Run(fine));
  }

  // A call that stays in progress past the timeout: Await gives up, says
  // so, and aborts the communicators.
  {
    host::InjectedFaults().in_progress_polls = 1 << 30;
    const Outcome o = Run({op++, 50, Algorithm::kRing, 1, DType::kF32, 64});
    host::ResetFaults();
    for (int r = 0; r < kRanks; ++r) {
      CHECK(!o.status[r].ok() && Contains(o.status[r], "made no progress for"));
    }
  }

  // Several processes: a unique id registered for (call site, group) before
  // the first call, as Python does through the key-value store; each such
  // call site gets its own communicators.
  {
    ncclUniqueId id;
    CHECK(cuda::NewUniqueId(&id).ok());
    const int64_t site = op++;
    cuda::RegisterUniqueId(site, 0, id);
    Call registered{site, 60, Algorithm::kHierarchical, 2, DType::kBF16, 77};
    const Outcome o = Run(registered);
    CheckSums("registered unique id", registered, o);
    const Outcome other = Run({op++, 60, Algorithm::kRing});
    for (int r = 0; r < kRanks; ++r) CHECK(o.flat[r] != other.flat[r]);
  }

  // The allreduce handler itself, called as XLA calls it.
  CheckMaskedHandler(op++);
  CheckScatterGatherHandlers(op);
  op += 2;
  CheckHandlerErrors(op++);

  // Late deliveries only delay.
  host::InjectedFaults().late_seconds = 0.01;
  cuda::SetTimeoutSeconds(30);
  Call late{op++, 0, Algorithm::kHierarchical, 4, DType::kBF16, 100};
  CheckSums("late", late, Run(late));
  host::ResetFaults();

  return Result();
}
