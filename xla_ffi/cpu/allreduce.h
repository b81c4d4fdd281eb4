// The allreduce schedules of the CPU backend behind one call, shared by the
// FFI handler and the pybind11 thread harness.
#pragma once

#include <functional>
#include <vector>

#include "algorithm/schedule.h"
#include "cpu/collective.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cpu {

// Runs `algorithm` on n contiguous elements over the rings of `rings`.
Status ReduceContiguous(Rings& rings, Algorithm algorithm, const ReduceSpec& spec, const void* in,
                        void* out, size_t n);

// The schedule `site` runs: the one it names, except that direct needs shared
// memory, which does not reach other processes; there the ring runs.
Algorithm ScheduleOf(const CallSite& site);

// The direct schedule for this rank of `site`: leaves its buffers (one in and
// one out per part, `parts` elements each) at the rendezvous and returns;
// the last rank to arrive runs the reduction and calls `done` (on its thread).
void ArriveDirectThen(const CallSite& site, const ReduceSpec& spec, std::vector<size_t> parts,
                      std::vector<const void*> in, std::vector<void*> out,
                      std::function<void(const Status&)> done);

// The same, as a future that the last rank to arrive completes, after running
// `on_success` (on whichever thread completes it) when the reduction succeeded.
xla::ffi::Future ArriveDirectFuture(const CallSite& site, const ReduceSpec& spec,
                                    std::vector<size_t> parts, std::vector<const void*> in,
                                    std::vector<void*> out,
                                    std::function<void()> on_success = nullptr);

// A chunk mask's selected chunks (masked allreduces travel as these, packed):
// the first `slots` chunks `mask` selects, as [begin, end) element ranges of
// a pool of n elements, in increasing order.
std::vector<Range> SelectedChunks(const bool* mask, size_t nchunks, size_t chunk_size, size_t n,
                                  size_t slots);

// Copies the selected chunks of `in` next to each other into `packed`
// (elements of `isz` bytes).
void Pack(const std::vector<Range>& chunks, const char* in, char* packed, size_t isz);

// out = in (or zeros, `zero`: then `in` is not read), with the selected
// chunks taken from `packed`.
void Unpack(const std::vector<Range>& chunks, const char* in, const char* packed, char* out,
            size_t n, size_t isz, bool zero);

}  // namespace jaxcomm::cpu
