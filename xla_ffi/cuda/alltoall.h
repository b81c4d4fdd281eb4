// The all-to-all allreduce: what travels is the wire type, what adds is the
// accumulator type, and the whole call is two NCCL launches on the stream,
// with nothing for the host to wait on between them:
//   1. encode: the input, prescaled (and clamped for a mean), cast to the
//      wire, into N shards of ceil(n/N) elements;
//   2. one ncclGroupStart/End of N-1 ncclSend and N-1 ncclRecv: shard q
//      goes to rank q, so rank r receives every rank's shard r;
//   3. one kernel adds the N shards of shard r in rank order in float32
//      (float64 for float64 input), clamps a mean to the wire's largest
//      finite value, applies the postscale and rounds to the wire;
//   4. one ncclAllGather of the reduced wire shards, then one decode.
// Every rank sends (n - n/N) wire elements in step 2 and (N-1) ceil(n/N) in
// step 4, the ring's bytes, in 2 NCCL launches instead of 2(N-1) host-polled
// steps. Every rank decodes the same gathered bytes, so all hold the same bits.
#pragma once

#include <cstddef>

#include "common/reduce_spec.h"
#include "common/status.h"
#include "cuda/comm_set.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"

namespace jaxcomm::cuda {

// out = postscale * sum_ranks(prescale * in) over the set's flat group.
Status AllToAllAllReduce(const CommSet& set, CudaKernels& k, cudaStream_t stream, Scratch& scratch,
                         const ReduceSpec& spec, const void* in, void* out, size_t n);

}  // namespace jaxcomm::cuda
