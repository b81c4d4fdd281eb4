#include "cuda/collective.h"

#include <string>

#include "cuda/alltoall.h"
#include "cuda/check.h"
#include "cuda/nccl_transport.h"
#include "cuda/runtime.h"

namespace jaxcomm::cuda {

Status RunOnOwnComms(cudaStream_t stream, int device, const int32_t* coords, int64_t op_id,
                     int nranks, const CollectiveBody& body, Lane lane) {
  ScopedDevice scoped(device);
  JAXCOMM_RETURN_IF_ERROR(scoped.status());
  RankComms* rc = nullptr;
  JAXCOMM_RETURN_IF_ERROR(CommsForCall(stream, coords, op_id, device, nranks, &rc, lane));
  std::lock_guard<std::mutex> lock(rc->mu);
  if (!rc->failure.empty()) return Status(Code::kAborted, rc->failure);
  if (rc->size != nranks) {
    return Status(Code::kInvalidArgument,
                  "jaxcomm: call site " + std::to_string(op_id) + " changed its group size");
  }
  // The watchdog's clock starts at this event, not now: work queued ahead
  // on the stream must not count against this call's timeout.
  cudaEvent_t start;
  JAXCOMM_RETURN_IF_ERROR(RecordEvent(stream, &start));
  CommSet set;
  set.flat = rc->flat;
  set.rank = rc->rank;
  set.size = rc->size;
  set.split = [rc](int intra_size, ncclComm_t* intra, ncclComm_t* inter) {
    RankComms::Split split;
    JAXCOMM_RETURN_IF_ERROR(SplitFor(*rc, intra_size, &split));
    *intra = split.intra;
    *inter = split.inter;
    return Status::Ok();
  };
  set.await = [rc](ncclComm_t comm, const char* what) { return Await(*rc, comm, what); };
  CudaKernels k(stream);
  Status st = body(set, k);
  if (st.ok()) st = k.status();
  if (!st.ok()) {
    cudaEventDestroy(start);
    return st;
  }
  return Watch(*rc, stream, start);
}

namespace {

// NCCL sums float16 in float16 at every hop; only the wider types may take
// the ncclAllReduce path and still add in the accumulator type.
bool NcclAddsInAccumulator(const ReduceSpec& spec, ncclDataType_t* type) {
  if (spec.wire != spec.input) return false;
  if (spec.input == DType::kF32) *type = ncclFloat32;
  if (spec.input == DType::kF64) *type = ncclFloat64;
  return spec.input == DType::kF32 || spec.input == DType::kF64;
}

}  // namespace

Status ReduceContiguous(const CommSet& set, CudaKernels& k, cudaStream_t stream, Scratch& scratch,
                        Algorithm algorithm, int intra_size, const ReduceSpec& spec, const void* in,
                        void* out, size_t n) {
  ncclDataType_t type;
  if (algorithm == Algorithm::kDirect && NcclAddsInAccumulator(spec, &type)) {
    if (n > 0) {
      JAXCOMM_NCCL_RETURN_IF_ERROR(ncclAllReduce(in, out, n, type, ncclSum, set.flat, stream),
                                   set.flat);
      JAXCOMM_RETURN_IF_ERROR(set.await(set.flat, "ncclAllReduce"));
    }
    // Linear, so both scales can wait until after the sum.
    const double scale = spec.prescale * spec.postscale;
    if (scale != 1.0) k.Convert(out, spec.input, out, spec.input, n, scale);
    return Status::Ok();
  }
  // Where NCCL would add in 16 bits, or a wire narrows the input: two NCCL
  // launches with float32 adds between them, against the ring's 2(N-1)
  // host-polled steps.
  if (algorithm == Algorithm::kDirect || algorithm == Algorithm::kAllToAll) {
    return AllToAllAllReduce(set, k, stream, scratch, spec, in, out, n);
  }
  void* block = nullptr;
  if (algorithm == Algorithm::kHierarchical) {
    if (intra_size < 1 || set.size % intra_size != 0) {
      return Status(Code::kInvalidArgument, "jaxcomm: hierarchical needs the group size (" +
                                                std::to_string(set.size) +
                                                ") to be a multiple of the ranks per node (" +
                                                std::to_string(intra_size) + ")");
    }
    ncclComm_t intra_comm = nullptr, inter_comm = nullptr;
    JAXCOMM_RETURN_IF_ERROR(set.split(intra_size, &intra_comm, &inter_comm));
    const int L = intra_size;
    NcclTransport intra(set, intra_comm, set.rank % L, L, stream);
    NcclTransport inter(set, inter_comm, set.rank / L, set.size / L, stream);
    JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(AllReduceScratchBytes(n, spec, L), &block));
    return HierarchicalAllReduce(intra, inter, k, spec, in, out, n, block);
  }
  // kRing.
  NcclTransport flat(set, set.flat, set.rank, set.size, stream);
  JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(AllReduceScratchBytes(n, spec, set.size), &block));
  return RingAllReduce(flat, k, spec, in, out, n, block);
}

}  // namespace jaxcomm::cuda
