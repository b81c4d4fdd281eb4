// Which elements each (block, thread) of the elementwise and chunk-copy
// kernels in kernels.cu handles, and the grids they launch. Loads of one or
// two bytes a thread keep too few bytes in flight to reach the memory's
// bandwidth, so both move 16-byte vectors where alignment allows and single
// elements elsewhere. Plain C++ without CUDA types: tests/cuda_host checks
// on the host, with these same functions, that every element is handled
// exactly once and every vector access is aligned.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/chunk_layout.h"  // JAXCOMM_HD, ChunkCount, ChunkLength

namespace jaxcomm::cuda {

constexpr int kThreads = 256;
constexpr int kItems = 4;                    // units a thread: loads in flight
constexpr size_t kTile = kThreads * kItems;  // units a block
constexpr size_t kVecBytes = 16;             // the widest load

// The unit (element or vector) that item k of `thread` handles in tile
// `tile`: consecutive threads take consecutive units, so accesses coalesce.
JAXCOMM_HD inline size_t TileUnit(size_t tile, size_t thread, int k) {
  return tile * kTile + static_cast<size_t>(k) * kThreads + thread;
}

// Blocks for one unit an item over `units` units (the scalar Elementwise).
JAXCOMM_HD inline size_t Tiles(size_t units) { return (units + kTile - 1) / kTile; }

// Elements a vector of a map from in_bytes to out_bytes elements: the wider
// side moves 16 bytes (float32 -> bfloat16: a 16-byte load, an 8-byte store).
JAXCOMM_HD constexpr size_t VecLen(size_t in_bytes, size_t out_bytes) {
  return kVecBytes / (in_bytes > out_bytes ? in_bytes : out_bytes);
}

// A map out[i] = f(in[i]) over n elements: [0, head) singly, `vecs` whole
// vectors from head (each vector-aligned in both buffers), [tail, n) singly.
// Where in and out sit at different offsets from a vector boundary, no
// index aligns both: `vector` is false and the scalar kernel does it all.
struct MapPlan {
  bool vector;
  size_t n, head, vecs, tail;
};

JAXCOMM_HD inline MapPlan PlanMap(uintptr_t in, size_t in_bytes, uintptr_t out, size_t out_bytes,
                                  size_t n) {
  const size_t vec = VecLen(in_bytes, out_bytes);
  MapPlan plan{false, n, 0, 0, n};
  if (in % in_bytes != 0 || out % out_bytes != 0) return plan;
  const size_t past_boundary = (in / in_bytes) % vec;
  if ((out / out_bytes) % vec != past_boundary) return plan;
  const size_t head = (vec - past_boundary) % vec;
  plan.vector = true;
  plan.head = head < n ? head : n;
  plan.vecs = (n - plan.head) / vec;
  plan.tail = plan.head + plan.vecs * vec;
  return plan;
}

// The vector kernel's grid: a tile of vectors a block, and one block for
// the head and tail when there are no whole vectors.
JAXCOMM_HD inline size_t MapBlocks(const MapPlan& plan) {
  if (plan.n == 0) return 0;
  return plan.vecs == 0 ? 1 : Tiles(plan.vecs);
}

// Head and tail are each shorter than a vector: block 0's thread t does the
// head's element t and the tail's element t (plan.tail + t).
JAXCOMM_HD inline bool DoesHeadElement(const MapPlan& plan, size_t block, size_t thread) {
  return block == 0 && thread < plan.head;
}
JAXCOMM_HD inline bool DoesTailElement(const MapPlan& plan, size_t block, size_t thread) {
  return block == 0 && thread < plan.n - plan.tail;
}

// Pack and unpack copy chunk by chunk, `tiles_per_chunk` blocks a chunk.
// Units are 16-byte vectors when every chunk starts 16-byte aligned in both
// buffers (bases aligned, chunk_size * elem_bytes a multiple of 16), else
// single elements; `vec` is the elements a unit.
struct ChunkCopyPlan {
  size_t vec;
  int64_t tiles_per_chunk, blocks;
};

// elem_bytes divides 16 (2, 4 or 8), chunk_size > 0.
JAXCOMM_HD inline ChunkCopyPlan PlanChunkCopy(uintptr_t src, uintptr_t dst, size_t n,
                                              size_t elem_bytes, int64_t chunk_size) {
  const bool aligned = src % kVecBytes == 0 && dst % kVecBytes == 0 &&
                       (static_cast<size_t>(chunk_size) * elem_bytes) % kVecBytes == 0;
  const size_t vec = aligned ? kVecBytes / elem_bytes : 1;
  const int64_t tiles = static_cast<int64_t>(Tiles(static_cast<size_t>(chunk_size) / vec));
  return {vec, tiles, static_cast<int64_t>(ChunkCount(n, chunk_size)) * tiles};
}

// A chunk of `len` elements: ChunkUnits(len, vec) whole units, then fewer
// than vec elements (a short last chunk's remainder) that tile 0's thread t
// copies singly, element ChunkUnits(len, vec) * vec + t.
JAXCOMM_HD inline size_t ChunkUnits(size_t len, size_t vec) { return len / vec; }
JAXCOMM_HD inline bool DoesRemainderElement(size_t len, size_t vec, int64_t tile, size_t thread) {
  return tile == 0 && thread < len % vec;
}

}  // namespace jaxcomm::cuda
