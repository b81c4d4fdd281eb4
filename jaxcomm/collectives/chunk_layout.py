"""ChunkLayout: how a flat pool is cut into chunks, decided in one place.

A pool of ``size`` elements is cut into ``ceil(size / chunk_size)`` chunks
of ``chunk_size`` elements, the last one shorter where ``chunk_size`` does
not divide ``size``. A chunk mask has one flag per chunk. The handlers in
xla_ffi/ derive the same geometry from xla_ffi/common/chunk_layout.h and
check a mask with the same messages (ffi_contract.h's CheckChunkMask).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxcomm import _validate
from jaxcomm._validate import is_integer

DEFAULT_CHUNK_SIZE = 32768  # GradientFlow's chunk: 32K elements


def check_chunk_size(chunk_size) -> int:
    """Raises ValueError unless `chunk_size` is a positive integer."""
    return _validate.check_positive_integer("chunk_size", chunk_size)


class ChunkLayout(NamedTuple):
    """A pool of `size` elements in chunks of `chunk_size` (checked).

    Examples:
      >>> from jaxcomm.collectives import ChunkLayout
      >>> layout = ChunkLayout.of(10, chunk_size=4)
      >>> layout.nchunks, layout.lengths.tolist()
      (3, [4, 4, 2])
      >>> float(layout.selected_elements(np.array([True, False, True])))  # 4 + 2
      6.0
    """

    size: int
    chunk_size: int

    @classmethod
    def of(cls, size: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ChunkLayout:
        return cls(int(size), check_chunk_size(chunk_size))

    @property
    def nchunks(self) -> int:
        """ceil(size / chunk_size): 0 for an empty pool."""
        return -(-self.size // self.chunk_size)

    @property
    def padded(self) -> int:
        """Elements in all chunks at full length (the last one padded)."""
        return self.nchunks * self.chunk_size

    @property
    def lengths(self) -> np.ndarray:
        """int64[nchunks]: each chunk's length."""
        starts = np.arange(self.nchunks, dtype=np.int64) * self.chunk_size
        return np.minimum(self.chunk_size, self.size - starts)

    def check_mask(self, mask, max_chunks=None) -> None:
        """Raises TypeError / ValueError unless `mask` is bool[nchunks] and
        `max_chunks` None or in [1, max(nchunks, 1)]."""
        if mask.dtype != jnp.bool_:
            raise TypeError(f"chunk_mask must be boolean, got {mask.dtype}")
        if mask.shape != (self.nchunks,):
            raise ValueError(
                f"chunk_mask has shape {mask.shape}; an input of {self.size} elements in chunks "
                f"of {self.chunk_size} needs shape ({self.nchunks},)"
            )
        bound = max(self.nchunks, 1)
        if max_chunks is not None and not (is_integer(max_chunks) and 0 < max_chunks <= bound):
            raise ValueError(
                f"max_chunks={max_chunks!r} must be None or an integer in [1, {bound}] "
                "(at most the chunk count of chunk_mask)"
            )

    def as_rows(self, flat):
        """flat[size] as [nchunks, chunk_size], the last chunk zero-padded."""
        return jnp.pad(flat, (0, self.padded - self.size)).reshape(self.nchunks, self.chunk_size)

    def elements(self, mask):
        """bool[size]: each chunk's flag in `mask` over its elements. A
        broadcast, which XLA fuses into what reads it; jnp.repeat builds the
        same with a scatter and a prefix sum over the whole pool."""
        rows = jnp.broadcast_to(mask[:, None], (mask.shape[0], self.chunk_size))
        return rows.reshape(-1)[: self.size]

    def selected_elements(self, mask):
        """float32: elements in the chunks `mask` selects (float32: an int32
        count overflows at 2 GiB of payload)."""
        return jnp.sum(jnp.where(mask, self.lengths.astype(np.float32), 0)).astype(jnp.float32)

    def density(self, mask):
        """float32: the fraction of the pool's elements in the chunks of `mask`."""
        return self.selected_elements(mask) / np.float32(self.size)

    def selected(self, density):
        """How many chunks a density selects: the ceiling, at least one. A
        Python float gives a Python int (a static bound); a traced density
        an int32 array."""
        n = self.nchunks
        if isinstance(density, float):
            return min(max(math.ceil(density * n - 1e-6), 1), n)
        k = jnp.ceil(density * n - 1e-6).astype(jnp.int32)
        return jnp.clip(k, 1, n)

    def reachable(self, density: float) -> float:
        """The fraction of chunks sent at `density`: at least one whole chunk."""
        return self.selected(density) / self.nchunks
