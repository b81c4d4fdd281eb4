#include "cuda/alltoall.h"

#include "algorithm/schedule.h"
#include "cuda/check.h"

namespace jaxcomm::cuda {
namespace {

char* At(void* base, size_t elems, DType t) { return static_cast<char*>(base) + elems * SizeOf(t); }
const char* At(const void* base, size_t elems, DType t) {
  return static_cast<const char*>(base) + elems * SizeOf(t);
}

// Step 2: shard q of `send` to rank q, shard `rank` of every rank into slot
// q of `recv`. Sizes come from ChunkRange, so peers skip the same empty
// transfers.
Status ExchangeShards(const CommSet& set, cudaStream_t stream, DType wire, const void* send,
                      void* recv, size_t n, size_t per) {
  const size_t ws = SizeOf(wire);
  const size_t mine = ChunkRange(n, set.size, set.rank).size();
  JAXCOMM_NCCL_RETURN_IF_ERROR(ncclGroupStart(), set.flat);
  Status st;
  for (int q = 0; q < set.size && st.ok(); ++q) {
    if (q == set.rank) continue;
    const size_t theirs = ChunkRange(n, set.size, q).size();
    if (theirs > 0) {
      st = FromNccl(ncclSend(At(send, q * per, wire), theirs * ws, ncclUint8, q, set.flat, stream),
                    "ncclSend", set.flat);
    }
    if (st.ok() && mine > 0) {
      st = FromNccl(ncclRecv(At(recv, q * per, wire), mine * ws, ncclUint8, q, set.flat, stream),
                    "ncclRecv", set.flat);
    }
  }
  // The group is closed even after a failed call, or NCCL stays in group mode.
  const Status end = FromNccl(ncclGroupEnd(), "ncclGroupEnd", set.flat);
  JAXCOMM_RETURN_IF_ERROR(st);
  JAXCOMM_RETURN_IF_ERROR(end);
  return set.await(set.flat, "all-to-all (ncclSend/ncclRecv)");
}

}  // namespace

Status AllToAllAllReduce(const CommSet& set, CudaKernels& k, cudaStream_t stream, Scratch& scratch,
                         const ReduceSpec& spec, const void* in, void* out, size_t n) {
  if (set.size == 1) {  // Nothing travels, so nothing is rounded to the wire type.
    k.Convert(out, spec.input, in, spec.input, n, spec.prescale * spec.postscale);
    return Status::Ok();
  }
  if (n == 0) return Status::Ok();
  const int N = set.size, r = set.rank;
  const DType wire = spec.wire;
  const size_t ws = SizeOf(wire);
  const size_t per = ChunkRange(n, N, 0).size();  // ceil(n / N): ncclAllGather's equal shards
  const size_t padded = per * N;
  // The input is its own wire encoding when nothing scales or casts it.
  const bool send_input = wire == spec.input && spec.prescale == 1.0;
  void* encoded = nullptr;
  if (!send_input) {
    JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(padded * ws, &encoded));
    JAXCOMM_RETURN_IF_ERROR(
        LaunchEncode(stream, in, spec.input, encoded, wire, n, spec.prescale, spec.saturate()));
  }
  const void* send = send_input ? in : encoded;
  // Gathered in place in the output where it has the room and the type;
  // otherwise over the encoded input, which the reduce no longer needs.
  void* gather = wire == spec.input && padded == n ? out : encoded;
  if (gather == nullptr) JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(padded * ws, &gather));
  void* recv = nullptr;
  JAXCOMM_RETURN_IF_ERROR(scratch.Allocate(padded * ws, &recv));

  JAXCOMM_RETURN_IF_ERROR(ExchangeShards(set, stream, wire, send, recv, n, per));
  JAXCOMM_RETURN_IF_ERROR(LaunchReduceShards(
      stream, recv, per, At(send, r * per, wire), r, N, wire, spec.acc(),
      ChunkRange(n, N, r).size(), per, spec.postscale, spec.saturate(), At(gather, r * per, wire)));
  JAXCOMM_NCCL_RETURN_IF_ERROR(
      ncclAllGather(At(gather, r * per, wire), gather, per * ws, ncclUint8, set.flat, stream),
      set.flat);
  JAXCOMM_RETURN_IF_ERROR(set.await(set.flat, "ncclAllGather"));
  if (gather != out) k.Convert(out, spec.input, gather, wire, n, 1.0);
  return Status::Ok();
}

}  // namespace jaxcomm::cuda
