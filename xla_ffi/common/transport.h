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

  // One ring phase: `steps` exchanges with the same neighbours, where what
  // step s+1 sends is what step s received, once `ops` has folded it in.
  // The default runs the steps one after another through SendRecv; a
  // transport that streams (TCP) overlaps them: bytes [b, e) of step s+1 go
  // out as soon as Arrived(s, b, e) returns, while the rest of step s still
  // arrives, so the link does not idle at a step's end.
  struct RingStep {
    const void* send;
    size_t send_bytes;
    void* recv;
    size_t recv_bytes;
  };
  class RingOps {
   public:
    virtual ~RingOps() = default;
    // Step s's buffers. Bytes [b, e) of step s+1's send must depend only on
    // bytes [b, e) of step s's receive (and the same step sizes).
    virtual RingStep Step(int s) = 0;
    // Bytes [begin, end) of step s's receive are in place; called in order,
    // on element boundaries, before any later byte of the stream is read.
    virtual void Arrived(int s, size_t begin, size_t end) = 0;
  };
  virtual Status RingPhase(int steps, int to, int from, RingOps& ops) {
    for (int s = 0; s < steps; ++s) {
      const RingStep b = ops.Step(s);
      JAXCOMM_RETURN_IF_ERROR(SendRecv(b.send, b.send_bytes, to, b.recv, b.recv_bytes, from));
      ops.Arrived(s, 0, b.recv_bytes);
    }
    return Status::Ok();
  }

  // Bytes this rank has handed to peers so far (the wire-byte accounting).
  uint64_t bytes_sent() const { return bytes_sent_; }

 protected:
  uint64_t bytes_sent_ = 0;
};

}  // namespace jaxcomm
