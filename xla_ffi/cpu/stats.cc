#include "cpu/stats.h"

#include <atomic>

namespace jaxcomm::cpu {
namespace {

// Device ordinals are small dense integers; a fixed table keeps the hot path
// to two relaxed atomic adds with no lock.
constexpr int kMaxDevices = 4096;
std::atomic<uint64_t> g_bytes[kMaxDevices];
std::atomic<uint64_t> g_calls[kMaxDevices];

}  // namespace

void RecordCall(int32_t device, uint64_t bytes_sent) {
  if (device < 0 || device >= kMaxDevices) return;
  g_bytes[device].fetch_add(bytes_sent, std::memory_order_relaxed);
  g_calls[device].fetch_add(1, std::memory_order_relaxed);
}

std::vector<DeviceStats> SnapshotStats() {
  std::vector<DeviceStats> out;
  for (int d = 0; d < kMaxDevices; ++d) {
    const uint64_t calls = g_calls[d].load(std::memory_order_relaxed);
    if (calls) out.push_back({d, g_bytes[d].load(std::memory_order_relaxed), calls});
  }
  return out;
}

void ResetStats() {
  for (int d = 0; d < kMaxDevices; ++d) {
    g_bytes[d].store(0, std::memory_order_relaxed);
    g_calls[d].store(0, std::memory_order_relaxed);
  }
}

}  // namespace jaxcomm::cpu
