// The thread -> element plans of kernels.cu (cuda/vector_plan.h), checked on
// the host: every (block, thread, item) of the grid the launch computes is
// walked the way VectorMap, Elementwise and ChunkCopyKernel walk it, and
// every element must be handled exactly once, in range, by accesses aligned
// to their width.
#include "cuda/vector_plan.h"

#include <cstddef>
#include <cstdint>
#include <iostream>
#include <random>
#include <vector>

#include "check.h"

using jaxcomm::ChunkCount;
using jaxcomm::ChunkLength;
using namespace jaxcomm::cuda;

namespace {

// Buffers start at a 64-byte boundary plus an offset in elements.
constexpr uintptr_t kInBase = 0x100000, kOutBase = 0x200000;

// Counts how often each of n elements is touched; anything out of range
// is a failure of its own.
struct Touched {
  explicit Touched(size_t n) : count(n, 0) {}
  void Add(size_t i) {
    if (i < count.size()) {
      ++count[i];
    } else {
      ++outside;
    }
  }
  bool Once() const {
    for (int c : count) {
      if (c != 1) return false;
    }
    return outside == 0;
  }
  std::vector<int> count;
  size_t outside = 0;
};

// One map of n elements from in_bytes to out_bytes elements, the buffers
// in_off and out_off elements past a 16-byte boundary; as LaunchMap does.
void CheckMap(size_t n, size_t in_bytes, size_t out_bytes, size_t in_off, size_t out_off) {
  const size_t vec = VecLen(in_bytes, out_bytes);
  const uintptr_t in = kInBase + in_off * in_bytes, out = kOutBase + out_off * out_bytes;
  const MapPlan plan = PlanMap(in, in_bytes, out, out_bytes, n);
  Touched touched(n);
  // Vectors wherever one index aligns both buffers.
  CHECK(plan.vector == (in_off % vec == out_off % vec));
  CHECK(plan.n == n);
  if (!plan.vector) {
    // The scalar Elementwise over Tiles(n) blocks.
    for (size_t block = 0; block < Tiles(n); ++block) {
      for (size_t thread = 0; thread < kThreads; ++thread) {
        for (int k = 0; k < kItems; ++k) {
          const size_t i = TileUnit(block, thread, k);
          if (i < n) touched.Add(i);
        }
      }
    }
  } else {
    // No more single elements than alignment requires.
    CHECK(plan.head < vec && plan.head <= n);
    CHECK(plan.tail <= n && n - plan.tail < vec);
    CHECK(plan.tail == plan.head + plan.vecs * vec);
    const size_t blocks = MapBlocks(plan);
    CHECK((n == 0) == (blocks == 0));
    if (blocks > 1) CHECK((blocks - 1) * kTile < plan.vecs);  // no idle block
    for (size_t block = 0; block < blocks; ++block) {
      for (size_t thread = 0; thread < kThreads; ++thread) {
        for (int k = 0; k < kItems; ++k) {
          const size_t v = TileUnit(block, thread, k);
          if (v >= plan.vecs) continue;
          const size_t first = plan.head + v * vec;
          CHECK((in + first * in_bytes) % (vec * in_bytes) == 0);
          CHECK((out + first * out_bytes) % (vec * out_bytes) == 0);
          for (size_t e = 0; e < vec; ++e) touched.Add(first + e);
        }
        if (DoesHeadElement(plan, block, thread)) touched.Add(thread);
        if (DoesTailElement(plan, block, thread)) touched.Add(plan.tail + thread);
      }
    }
  }
  if (!touched.Once()) {
    std::cout << "map n=" << n << " bytes " << in_bytes << "->" << out_bytes << " offsets "
              << in_off << "," << out_off << "\n";
  }
  CHECK(touched.Once());
}

// The chunk offsets LaunchChunkOffsets computes.
std::vector<int32_t> Offsets(const std::vector<bool>& mask) {
  std::vector<int32_t> offsets(mask.size() + 1, 0);
  for (size_t c = 0; c < mask.size(); ++c) offsets[c + 1] = offsets[c] + (mask[c] ? 1 : 0);
  return offsets;
}

// Pack (or unpack) of n elements of elem_bytes in chunks of chunk_size, the
// buffers src_off and dst_off bytes past a 16-byte boundary; the element
// values are their indices, so each copy is checked against the
// destination it should reach.
void CheckChunkCopy(bool pack, size_t n, size_t elem_bytes, int64_t chunk_size,
                    const std::vector<bool>& mask, int64_t slots, size_t src_off, size_t dst_off) {
  const std::vector<int32_t> offsets = Offsets(mask);
  const int64_t nchunks = static_cast<int64_t>(mask.size());
  const uintptr_t src = kInBase + src_off, dst = kOutBase + dst_off;
  const ChunkCopyPlan plan = PlanChunkCopy(src, dst, n, elem_bytes, chunk_size);
  const bool aligned =
      src_off % 16 == 0 && dst_off % 16 == 0 && (chunk_size * elem_bytes) % 16 == 0;
  CHECK(plan.vec == (aligned ? 16 / elem_bytes : 1));
  CHECK(plan.blocks == nchunks * plan.tiles_per_chunk);
  CHECK(plan.tiles_per_chunk >= 1);
  // The packed buffer holds `slots` chunks; x holds n elements.
  const size_t packed_size = static_cast<size_t>(slots) * chunk_size;
  const size_t src_size = pack ? n : packed_size, dst_size = pack ? packed_size : n;
  // want[d]: the source element that lands at dst[d], or none.
  std::vector<int64_t> want(dst_size, -1);
  for (int64_t c = 0; c < nchunks; ++c) {
    if (!mask[c] || offsets[c] >= slots) continue;
    for (size_t j = 0; j < ChunkLength(c, n, chunk_size); ++j) {
      const size_t x = c * chunk_size + j, p = offsets[c] * chunk_size + j;
      if (pack) {
        want[p] = static_cast<int64_t>(x);
      } else {
        want[x] = static_cast<int64_t>(p);
      }
    }
  }
  std::vector<int64_t> got(dst_size, -1);
  Touched touched(dst_size);
  size_t read_outside = 0;
  auto copy = [&](size_t to, size_t from) {
    if (from >= src_size) ++read_outside;
    touched.Add(to);
    if (to < dst_size) got[to] = static_cast<int64_t>(from);
  };
  for (int64_t block = 0; block < plan.blocks; ++block) {
    const int64_t c = block / plan.tiles_per_chunk;
    if (!mask[c] || offsets[c] >= slots) continue;  // the early exit
    const int64_t tile = block % plan.tiles_per_chunk;
    const size_t chunk_begin = c * chunk_size, packed_begin = offsets[c] * chunk_size;
    const size_t from = pack ? chunk_begin : packed_begin, to = pack ? packed_begin : chunk_begin;
    const size_t len = ChunkLength(c, n, chunk_size);
    const size_t units = ChunkUnits(len, plan.vec);
    for (size_t thread = 0; thread < kThreads; ++thread) {
      for (int k = 0; k < kItems; ++k) {
        const size_t u = TileUnit(tile, thread, k);
        if (u >= units) continue;
        const size_t first = u * plan.vec;
        CHECK((src + (from + first) * elem_bytes) % (plan.vec * elem_bytes) == 0);
        CHECK((dst + (to + first) * elem_bytes) % (plan.vec * elem_bytes) == 0);
        for (size_t e = 0; e < plan.vec; ++e) copy(to + first + e, from + first + e);
      }
      if (DoesRemainderElement(len, plan.vec, tile, thread)) {
        const size_t j = units * plan.vec + thread;
        copy(to + j, from + j);
      }
    }
  }
  // Every selected element copied once to its place, nothing else written.
  bool right = touched.outside == 0 && read_outside == 0;
  for (size_t d = 0; d < dst_size; ++d) {
    right = right && got[d] == want[d] && touched.count[d] == (want[d] >= 0 ? 1 : 0);
  }
  if (!right) {
    std::cout << (pack ? "pack" : "unpack") << " n=" << n << " bytes " << elem_bytes << " chunk "
              << chunk_size << " slots " << slots << " offsets " << src_off << "," << dst_off
              << "\n";
  }
  CHECK(right);
}

}  // namespace

int main() {
  // (input, output) element sizes: every pair the map kernels instantiate.
  const size_t pairs[][2] = {{4, 2}, {2, 4}, {4, 4}, {8, 8}, {2, 2},
                             {8, 4}, {4, 8}, {8, 2}, {2, 8}};
  std::mt19937 rng(7);
  for (const auto& pair : pairs) {
    const size_t vec = VecLen(pair[0], pair[1]);
    CHECK(vec * (pair[0] > pair[1] ? pair[0] : pair[1]) == kVecBytes);
    std::vector<size_t> sizes = {0,
                                 1,
                                 vec - 1,
                                 vec,
                                 vec + 1,
                                 2 * vec - 1,
                                 2 * vec + 1,
                                 1000,
                                 4099,
                                 kTile * vec,
                                 kTile * vec + 1,
                                 kTile * vec - 1,
                                 3 * kTile * vec + 5};
    for (int r = 0; r < 4; ++r) sizes.push_back(rng() % 20000);
    for (size_t n : sizes) {
      for (size_t in_off = 0; in_off < vec; ++in_off) {
        for (size_t out_off = 0; out_off < vec; ++out_off) {
          CheckMap(n, pair[0], pair[1], in_off, out_off);
        }
      }
    }
  }

  // Chunk copies: chunks whose bytes are and are not whole vectors, short
  // last chunks, chunks larger than a tile, every chunk or a few selected,
  // `slots` cutting the selection short, bases aligned or not.
  const int64_t chunk_sizes[] = {1, 3, 8, 16, 24, 1000, 1024, 4104, 5000};
  const size_t ns[] = {1, 7, 100, 1001, 4096, 12345};
  for (size_t elem_bytes : {2, 4, 8}) {
    for (int64_t chunk_size : chunk_sizes) {
      for (size_t n : ns) {
        const size_t nchunks = ChunkCount(n, chunk_size);
        if (nchunks > 2000) continue;  // the small chunks need no large n
        std::vector<bool> all(nchunks, true), some(nchunks);
        for (size_t c = 0; c < nchunks; ++c) some[c] = rng() % 3 == 0;
        some.back() = true;  // the short last chunk too
        for (const auto* mask : {&all, &some}) {
          const int64_t selected = Offsets(*mask).back();
          for (int64_t slots : {selected, selected / 2}) {
            for (size_t src_off : {size_t{0}, elem_bytes}) {
              for (size_t dst_off : {size_t{0}, elem_bytes, size_t{16}}) {
                for (bool pack : {true, false}) {
                  CheckChunkCopy(pack, n, elem_bytes, chunk_size, *mask, slots, src_off, dst_off);
                }
              }
            }
          }
        }
      }
    }
  }
  return Result();
}
