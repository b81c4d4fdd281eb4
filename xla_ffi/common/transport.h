// What a schedule needs from the network: its place in a group, and one
// paired exchange. A ring step is exactly one SendRecv, which maps onto
// NCCL as ncclGroupStart(); ncclSend(); ncclRecv(); ncclGroupEnd() and onto
// the in-process transport as a copy out of the left neighbour's buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace jaxcomm {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Sends `send_bytes` from `send` to rank `to` and receives `recv_bytes` into
  // `recv` from rank `from`. Returns once `recv` holds the data and `send` may
  // be reused. Every rank of the group calls it the same number of times.
  virtual Status SendRecv(const void* send, size_t send_bytes, int to, void* recv,
                          size_t recv_bytes, int from) = 0;

  // Bytes this rank has handed to peers so far (the wire-byte accounting).
  uint64_t bytes_sent() const { return bytes_sent_; }

 protected:
  uint64_t bytes_sent_ = 0;
};

}  // namespace jaxcomm
