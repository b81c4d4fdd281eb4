// Per-device counters of what the CPU collectives moved, read from Python
// (jaxcomm.ffi_stats) for the wire-byte accounting.
#pragma once

#include <cstdint>
#include <vector>

namespace jaxcomm::cpu {

struct DeviceStats {
  int32_t device;
  uint64_t bytes_sent;
  uint64_t calls;
};

void RecordCall(int32_t device, uint64_t bytes_sent);
std::vector<DeviceStats> SnapshotStats();  // devices that made at least one call
void ResetStats();

}  // namespace jaxcomm::cpu
