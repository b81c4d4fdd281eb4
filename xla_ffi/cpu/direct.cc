#include "cpu/direct.h"

#include <algorithm>
#include <memory>

namespace jaxcomm::cpu {
namespace {

const char* Offset(const void* p, size_t elems, DType t) {
  return static_cast<const char*>(p) + elems * SizeOf(t);
}
char* Offset(void* p, size_t elems, DType t) { return static_cast<char*>(p) + elems * SizeOf(t); }

// Elements summed per pass: the partial sums stay in L1 while every peer's
// slice streams through once.
constexpr size_t kBlock = 4096;

}  // namespace

Status DirectAllReduce(InProcessTransport& t, Kernels& k, const ReduceSpec& spec, const void* in,
                       void* out, size_t n) {
  const int size = t.size(), r = t.rank();
  if (size == 1) {
    k.Convert(out, spec.input, in, spec.input, n, spec.prescale * spec.postscale);
    return Status::Ok();
  }
  const DType wire = spec.wire, acc = spec.acc();
  const Range own = ChunkRange(n, size, r);

  // What peers read from this rank: its contribution in the wire type, and
  // its reduced chunk (straight in the output when no cast is needed).
  std::unique_ptr<char[]> contribution_copy, result_copy;
  const void* contribution = in;
  if (wire != spec.input || spec.prescale != 1.0) {
    contribution_copy.reset(new char[n * SizeOf(wire)]);
    k.Convert(contribution_copy.get(), wire, in, spec.input, n, spec.prescale);
    contribution = contribution_copy.get();
  }
  void* result = Offset(out, own.begin, spec.input);
  if (wire != spec.input) {
    result_copy.reset(new char[std::max<size_t>(own.size(), 1) * SizeOf(wire)]);
    result = result_copy.get();
  }
  Slot& slot = t.slot();
  slot.Publish(r, contribution, result);
  JAXCOMM_RETURN_IF_ERROR(slot.Barrier(r, t.deadline()));

  // Phase 1: reduce the own chunk, ranks summed in order 0..N-1.
  alignas(64) double block_storage[kBlock];
  void* block = block_storage;
  for (size_t off = 0; off < own.size(); off += kBlock) {
    const size_t len = std::min(kBlock, own.size() - off);
    const size_t at = own.begin + off;
    k.Convert(block, acc, Offset(slot.PublishedA(0), at, wire), wire, len, 1.0);
    for (int j = 1; j < size; ++j) {
      k.Accumulate(block, acc, Offset(slot.PublishedA(j), at, wire), wire, len);
    }
    k.Convert(Offset(result, off, wire), wire, block, acc, len, spec.postscale);
  }
  JAXCOMM_RETURN_IF_ERROR(slot.Barrier(r, t.deadline()));

  // Phase 2: collect every owner's chunk, starting with the right neighbour's
  // so the ranks do not all read rank 0 at once.
  for (int i = 1; i <= size; ++i) {
    const int c = (r + i) % size;
    if (slot.PublishedB(c) == Offset(out, own.begin, spec.input)) continue;  // already in place
    const Range chunk = ChunkRange(n, size, c);
    k.Convert(Offset(out, chunk.begin, spec.input), spec.input, slot.PublishedB(c), wire,
              chunk.size(), 1.0);
  }
  // Peers may still be reading this rank's buffers until everyone is here.
  JAXCOMM_RETURN_IF_ERROR(slot.Barrier(r, t.deadline()));
  t.CountSent((n - own.size() + (size - 1) * own.size()) * SizeOf(wire));
  return Status::Ok();
}

}  // namespace jaxcomm::cpu
