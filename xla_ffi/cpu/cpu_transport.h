// What the CPU collective code needs from a transport beyond Transport: a
// way to give up so that the peers stop waiting for this rank.
#pragma once

#include <string>

#include "common/transport.h"

namespace jaxcomm::cpu {

class CpuTransport : public Transport {
 public:
  // Called once a rank fails: its peers should fail fast rather than time out.
  virtual void Abort(const std::string& reason) = 0;
};

}  // namespace jaxcomm::cpu
