// The allreduce split into a start and a done call (allreduce_async.cc): what
// Python reads of the operations in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace jaxcomm::cpu {

// One finished operation, times in seconds of time.monotonic()'s clock.
struct AsyncEvent {
  int32_t device;
  int64_t op_id;
  int64_t sequence;
  int64_t bytes;    // the input's
  double started;   // the start call returned
  double reduced;   // the exchange completed
  double landed;    // the done call began
  double returned;  // the done call wrote its result
};

// The last few thousand operations whose done call returned, oldest first.
std::vector<AsyncEvent> AsyncTimeline();

// Operations started whose done call has not taken them yet.
size_t AllReducesInFlight();

}  // namespace jaxcomm::cpu
