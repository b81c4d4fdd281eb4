// Running a collective off XLA's threads.
//
// A CPU collective blocks until its peers arrive. XLA's CPU runtime runs
// independent custom calls concurrently and not in the same order on every
// device, on a thread pool of fixed size; handlers that block those threads
// starve the devices that still need one to reach the call (with ~25 fused
// buckets per step on 8 devices this deadlocked until the timeout). So the
// handlers return an ffi::Future at once and the collective runs on a
// jaxcomm worker thread; XLA keeps the buffers alive until it completes.
#pragma once

#include <functional>

#include "cpu/collective.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {

namespace ffi = xla::ffi;

// A future that is already complete: for argument errors found up front.
ffi::Future CompletedFuture(const ffi::Error& error);

// RunCollective(site, body) on a worker thread; the future completes with
// its status. Workers are reused, and one is added whenever all are busy,
// so a blocked collective never delays another one.
ffi::Future RunCollectiveAsync(CallSite site, std::function<Status(Rings&)> body);

// Runs `task` on a worker thread (the same pool), at once.
void RunOnWorker(std::function<void()> task);

// Worker threads started so far (they are kept for reuse).
int WorkerThreads();

}  // namespace jaxcomm::cpu
