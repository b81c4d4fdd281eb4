"""Flat buffers back into arrays: the one helper every layer uses."""

from __future__ import annotations

import math


def split(flat, shapes) -> list:
    """`flat` (1-D) cut into consecutive pieces reshaped to `shapes`, in order.

    Examples:
      >>> import numpy as np
      >>> [p.tolist() for p in split(np.arange(5), [(2,), (1, 3)])]
      [[0, 1], [[2, 3, 4]]]
    """
    pieces, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        pieces.append(flat[offset : offset + n].reshape(shape))
        offset += n
    return pieces
