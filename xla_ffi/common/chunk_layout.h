// How a masked allreduce cuts a flat buffer of `elements` into chunks of
// `chunk_size` elements, the last one possibly shorter: the one definition
// the checks, the CPU loops, the CUDA kernels and their host stand-ins use.
// Every function takes chunk_size > 0 (CheckChunkMask checks it first).
#pragma once

#include <cstddef>

// Callable from CUDA kernels too where nvcc compiles it.
#if defined(__CUDACC__)
#define JAXCOMM_HD __host__ __device__
#else
#define JAXCOMM_HD
#endif

namespace jaxcomm {

// ceil(elements / chunk_size), without overflowing near SIZE_MAX.
JAXCOMM_HD inline size_t ChunkCount(size_t elements, size_t chunk_size) {
  return elements / chunk_size + (elements % chunk_size != 0 ? 1 : 0);
}

// The elements of chunk `index` < ChunkCount(elements, chunk_size): all of
// chunk_size but for the last chunk, which holds what is left.
JAXCOMM_HD inline size_t ChunkLength(size_t index, size_t elements, size_t chunk_size) {
  const size_t left = elements - index * chunk_size;
  return left < chunk_size ? left : chunk_size;
}

}  // namespace jaxcomm
