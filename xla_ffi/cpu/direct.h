// The shared-memory allreduce, in which no thread waits for a peer.
//
// On one host the ring's N-1 dependent steps are pure overhead: all memory is
// one hop away. So each rank only leaves its buffers at the rendezvous and
// returns; the last rank to arrive sums every element over the ranks (in rank
// order 0..N-1, so all ranks get the same bits) and writes the sum straight
// into every rank's output, sharing the elements with a few worker threads.
// Every input byte is read once and every output byte written once, the
// least any allreduce moves through memory. A rank that never arrives is
// reported by a watchdog once the deadline passes.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "algorithm/schedule.h"
#include "cpu/rendezvous.h"

namespace jaxcomm::cpu {

// What all ranks of one call share; they must agree on all of it.
struct DirectCall {
  SlotKey key;
  int nranks;
  CallSignature sig;
  ReduceSpec spec;
  std::vector<size_t> parts;  // elements of each buffer of a rank
};

// One rank's part of a call: a buffer in and out per part of the call,
// reduced as if they lay one after another (a bucket of leaves, without
// copying them together first).
struct DirectRank {
  int rank;
  int device;  // for stats
  std::vector<const void*> in;
  std::vector<void*> out;
  std::function<void(const Status&)> done;  // called once, from any thread
};

// Registers `me`; when it is the last rank, runs the reduction before
// returning (on this thread and workers). Never blocks on a peer.
void ArriveDirect(const DirectCall& call, DirectRank me);

// Direct calls whose ranks are still arriving (0 when none is running).
size_t LiveDirectSlots();

}  // namespace jaxcomm::cpu
