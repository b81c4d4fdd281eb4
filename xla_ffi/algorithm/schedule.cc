#include "algorithm/schedule.h"

#include <algorithm>

namespace jaxcomm {
namespace {

int Mod(int a, int n) { return ((a % n) + n) % n; }
size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }
size_t Align(size_t bytes) { return (bytes + 63) / 64 * 64; }

char* At(void* base, size_t elems, DType t) { return static_cast<char*>(base) + elems * SizeOf(t); }
const char* At(const void* base, size_t elems, DType t) {
  return static_cast<const char*>(base) + elems * SizeOf(t);
}

// Staging for one ring phase: one chunk to send (when the wire type differs
// from the accumulator) and one chunk to receive.
struct Staging {
  void* send;
  void* recv;
};

// Where the accumulator's values come from: `in` (of type `type`) times
// `prescale`; with in == nullptr they are in the accumulator already.
struct Source {
  const void* in = nullptr;
  DType type = DType::kF32;
  double prescale = 1.0;
};

// Ring reduce-scatter over the n accumulator elements at `acc`. Step s sends
// chunk r-s-1 to the right and adds chunk r-s-2 from the left, so after
// size-1 steps chunk r holds the sum over the group.
Status ReduceScatterPhase(Transport& t, Kernels& k, DType acc_type, DType wire, bool saturate,
                          void* acc, size_t n, Staging staging, Source src) {
  const int size = t.size(), r = t.rank();
  const int right = Mod(r + 1, size), left = Mod(r - 1, size);
  const size_t ws = SizeOf(wire);
  auto fill = [&](Range c) {
    if (src.in == nullptr) return;
    k.Convert(At(acc, c.begin, acc_type), acc_type, At(src.in, c.begin, src.type), src.type,
              c.size(), src.prescale);
  };
  if (wire == acc_type && size > 1) {
    // Nothing to convert for the wire: step s+1 sends straight from the
    // accumulator what step s added into it, so the transport may stream the
    // steps. The input is copied into the accumulator piece by piece as it
    // arrives too, not all before the first byte goes out (a 64 MiB copy
    // into fresh pages cost ~0.1 s, 10% of a 1 Gbit/s allreduce).
    struct Ops final : Transport::RingOps {
      Kernels& k;
      DType type;
      bool saturate;
      char* acc;
      char* recv;
      Source src;
      size_t n, ws;
      int size, r, steps;
      bool direct;  // step 0 sends the input as it is
      Ops(Kernels& k, DType type, bool saturate, void* acc, void* recv, Source src, size_t n,
          int size, int r)
          : k(k),
            type(type),
            saturate(saturate),
            acc(static_cast<char*>(acc)),
            recv(static_cast<char*>(recv)),
            src(src),
            n(n),
            ws(SizeOf(type)),
            size(size),
            r(r),
            steps(size - 1),
            direct(src.in != nullptr && src.type == type && src.prescale == 1.0 && !saturate) {}
      Range Out(int s) const { return ChunkRange(n, size, Mod(r - s - 1, size)); }
      Range In(int s) const { return ChunkRange(n, size, Mod(r - s - 2, size)); }
      Transport::RingStep Step(int s) override {
        // Step 0's chunk is not read again by this rank, so it need not be copied.
        const char* send = s == 0 && direct ? static_cast<const char*>(At(src.in, 0, type)) : acc;
        return {send + Out(s).begin * ws, Out(s).size() * ws, recv, In(s).size() * ws};
      }
      void Arrived(int s, size_t begin, size_t end) override {
        const size_t first = In(s).begin + begin / ws, count = (end - begin) / ws;
        char* into = acc + first * ws;
        if (src.in != nullptr) {
          k.Convert(into, type, At(src.in, first, src.type), src.type, count, src.prescale);
        }
        k.Accumulate(into, type, recv + begin, type, count);
        // Clamped as it would be before step s+1 sends it (the last step's
        // chunk is this rank's own, which the caller treats).
        if (saturate && s + 1 < steps) k.Saturate(into, type, type, count);
      }
    } ops(k, acc_type, saturate, acc, staging.recv, src, n, size, r);
    if (!ops.direct) fill(ops.Out(0));
    if (saturate) {
      const Range first = ops.Out(0);
      k.Saturate(At(acc, first.begin, acc_type), acc_type, wire, first.size());
    }
    return t.RingPhase(size - 1, right, left, ops);
  }
  fill({0, n});
  for (int s = 0; s + 1 < size; ++s) {
    const Range out = ChunkRange(n, size, Mod(r - s - 1, size));
    const Range in = ChunkRange(n, size, Mod(r - s - 2, size));
    void* send_acc = At(acc, out.begin, acc_type);  // not read again by this rank
    if (saturate) k.Saturate(send_acc, acc_type, wire, out.size());
    const void* send = send_acc;
    if (wire != acc_type) {
      k.Convert(staging.send, wire, send, acc_type, out.size(), 1.0);
      send = staging.send;
    }
    JAXCOMM_RETURN_IF_ERROR(
        t.SendRecv(send, out.size() * ws, right, staging.recv, in.size() * ws, left));
    k.Accumulate(At(acc, in.begin, acc_type), acc_type, staging.recv, wire, in.size());
  }
  return Status::Ok();
}

// Ring allgather over the n wire elements at `g`, where chunk r is already
// in place. Step s forwards chunk r-s and receives chunk r-s-1 in place.
Status AllGatherPhase(Transport& t, DType wire, void* g, size_t n) {
  const int size = t.size(), r = t.rank();
  struct Ops final : Transport::RingOps {
    char* g;
    size_t n, ws;
    int size, r;
    Ops(void* g, size_t n, size_t ws, int size, int r)
        : g(static_cast<char*>(g)), n(n), ws(ws), size(size), r(r) {}
    Transport::RingStep Step(int s) override {
      const Range out = ChunkRange(n, size, Mod(r - s, size));
      const Range in = ChunkRange(n, size, Mod(r - s - 1, size));
      return {g + out.begin * ws, out.size() * ws, g + in.begin * ws, in.size() * ws};
    }
    void Arrived(int, size_t, size_t) override {}  // received in place, forwarded as is
  } ops(g, n, SizeOf(wire), size, r);
  return t.RingPhase(size - 1, Mod(r + 1, size), Mod(r - 1, size), ops);
}

// Carves the caller's scratch block: accumulator, staging, and (unless the
// output can hold it) the wire-typed gather buffer.
struct AllReduceBuffers {
  void* acc;
  Staging staging;
  void* gather;
};

AllReduceBuffers Carve(void* scratch, void* out, size_t n, const ReduceSpec& spec, int parts,
                       bool out_holds_n = true) {
  char* p = static_cast<char*>(scratch);
  const size_t chunk = CeilDiv(n, std::max(parts, 1)) * SizeOf(spec.wire);
  AllReduceBuffers b;
  // With no type change anywhere, the output itself is the accumulator: after
  // the reduce-scatter only the own chunk is live, and the allgather fills the rest.
  const bool in_place = out_holds_n && spec.input == spec.acc() && spec.wire == spec.input;
  b.acc = in_place ? out : p;
  if (!in_place) p += Align(n * SizeOf(spec.acc()));
  b.staging.send = p;
  p += Align(chunk);
  b.staging.recv = p;
  p += Align(chunk);
  b.gather = spec.wire == spec.input ? out : p;
  return b;
}

}  // namespace

Range ChunkRange(size_t n, int parts, int c) {
  const size_t per = CeilDiv(n, static_cast<size_t>(parts));
  return {std::min(n, per * c), std::min(n, per * (c + 1))};
}

size_t AllReduceScratchBytes(size_t n, const ReduceSpec& spec, int parts) {
  const size_t chunk = CeilDiv(n, std::max(parts, 1)) * SizeOf(spec.wire);
  const size_t gather = spec.wire == spec.input ? 0 : n * SizeOf(spec.wire);
  const bool in_place = spec.input == spec.acc() && spec.wire == spec.input;
  return (in_place ? 0 : Align(n * SizeOf(spec.acc()))) + 2 * Align(chunk) + Align(gather);
}

Status RingAllReduce(Transport& t, Kernels& k, const ReduceSpec& spec, const void* in, void* out,
                     size_t n, void* scratch) {
  const DType acc = spec.acc();
  if (t.size() == 1) {  // Nothing travels, so nothing is rounded to the wire type.
    k.Convert(out, spec.input, in, spec.input, n, spec.prescale * spec.postscale);
    return Status::Ok();
  }
  AllReduceBuffers b = Carve(scratch, out, n, spec, t.size());
  JAXCOMM_RETURN_IF_ERROR(ReduceScatterPhase(t, k, acc, spec.wire, spec.saturate(), b.acc, n,
                                             b.staging, {in, spec.input, spec.prescale}));
  const Range own = ChunkRange(n, t.size(), t.rank());
  if (spec.saturate()) k.Saturate(At(b.acc, own.begin, acc), acc, spec.wire, own.size());
  k.Convert(At(b.gather, own.begin, spec.wire), spec.wire, At(b.acc, own.begin, acc), acc,
            own.size(), spec.postscale);
  JAXCOMM_RETURN_IF_ERROR(AllGatherPhase(t, spec.wire, b.gather, n));
  k.Convert(out, spec.input, b.gather, spec.wire, n, 1.0);
  return Status::Ok();
}

Status HierarchicalAllReduce(Transport& intra, Transport& inter, Kernels& k, const ReduceSpec& spec,
                             const void* in, void* out, size_t n, void* scratch) {
  const DType acc = spec.acc();
  if (intra.size() * inter.size() == 1) {
    k.Convert(out, spec.input, in, spec.input, n, spec.prescale * spec.postscale);
    return Status::Ok();
  }
  AllReduceBuffers b = Carve(scratch, out, n, spec, intra.size());
  // 1. Inside the node: after this, this rank's intra chunk holds the node's sum.
  JAXCOMM_RETURN_IF_ERROR(ReduceScatterPhase(intra, k, acc, spec.wire, spec.saturate(), b.acc, n,
                                             b.staging, {in, spec.input, spec.prescale}));
  // 2. Across nodes, on that 1/L shard only: a ring allreduce of the shard.
  const Range shard = ChunkRange(n, intra.size(), intra.rank());
  void* shard_acc = At(b.acc, shard.begin, acc);
  void* shard_gather = At(b.gather, shard.begin, spec.wire);
  JAXCOMM_RETURN_IF_ERROR(ReduceScatterPhase(inter, k, acc, spec.wire, spec.saturate(), shard_acc,
                                             shard.size(), b.staging, Source{}));
  const Range own = ChunkRange(shard.size(), inter.size(), inter.rank());
  if (spec.saturate()) k.Saturate(At(shard_acc, own.begin, acc), acc, spec.wire, own.size());
  k.Convert(At(shard_gather, own.begin, spec.wire), spec.wire, At(shard_acc, own.begin, acc), acc,
            own.size(), spec.postscale);
  JAXCOMM_RETURN_IF_ERROR(AllGatherPhase(inter, spec.wire, shard_gather, shard.size()));
  // 3. Inside the node again: every rank collects the node's shards.
  JAXCOMM_RETURN_IF_ERROR(AllGatherPhase(intra, spec.wire, b.gather, n));
  k.Convert(out, spec.input, b.gather, spec.wire, n, 1.0);
  return Status::Ok();
}

size_t ReduceScatterScratchBytes(size_t n, const ReduceSpec& spec, int group) {
  const size_t chunk = CeilDiv(n, std::max(group, 1)) * SizeOf(spec.wire);
  return Align(n * SizeOf(spec.acc())) + 2 * Align(chunk);
}

Status RingReduceScatter(Transport& t, Kernels& k, const ReduceSpec& spec, const void* in,
                         void* out, size_t n, void* scratch) {
  const DType acc = spec.acc();
  const size_t per = CeilDiv(n, static_cast<size_t>(t.size()));
  AllReduceBuffers b = Carve(scratch, out, n, spec, t.size(), /*out_holds_n=*/false);
  JAXCOMM_RETURN_IF_ERROR(ReduceScatterPhase(t, k, acc, spec.wire, spec.saturate(), b.acc, n,
                                             b.staging, {in, spec.input, spec.prescale}));
  const Range own = ChunkRange(n, t.size(), t.rank());
  k.Convert(out, spec.input, At(b.acc, own.begin, acc), acc, own.size(), spec.postscale);
  // Chunks past the end of the input are padding: zero, like psum_scatter of zeros.
  k.Zero(At(out, own.size(), spec.input), (per - own.size()) * SizeOf(spec.input));
  return Status::Ok();
}

size_t AllGatherScratchBytes(size_t m, DType input, DType wire, int group) {
  return wire == input ? 0 : Align(m * group * SizeOf(wire));
}

Status RingAllGather(Transport& t, Kernels& k, DType input, DType wire, const void* in, void* out,
                     size_t m, void* scratch) {
  const size_t n = m * t.size();
  void* gather = wire == input ? out : scratch;
  // Own block also goes through the wire type so every rank holds the same bytes.
  k.Convert(At(gather, m * t.rank(), wire), wire, in, input, m, 1.0);
  JAXCOMM_RETURN_IF_ERROR(AllGatherPhase(t, wire, gather, n));
  if (gather != out) k.Convert(out, input, gather, wire, n, 1.0);
  return Status::Ok();
}

}  // namespace jaxcomm
