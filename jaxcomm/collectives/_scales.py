"""What travels and how it is scaled: the wire dtype and (prescale, postscale).

Every backend follows one contract: cast(x * prescale) travels, the reduced
value is multiplied by postscale and cast back (see _xla.py).
"""

from __future__ import annotations

import numpy as np


def is_narrow(wire) -> bool:
    """A 16- or 8-bit wire: it rounds float32 values, and float16 overflows
    where float32 does not (8-bit wires are scaled by _fp8). `wire` is a
    checked dtype or None (the input's)."""
    return wire is not None and np.dtype(wire).itemsize < 4


def wire_for(dtype, wire_dtype) -> np.dtype:
    """The dtype that travels for an input of `dtype`; `wire_dtype` is checked."""
    return np.dtype(dtype) if wire_dtype is None else np.dtype(wire_dtype)


def scales(op: str, size: int, cast: bool) -> tuple[float, float]:
    """(prescale, postscale). For a mean whose input is cast for the wire,
    divide before the cast so large N cannot overflow float16; otherwise
    divide at the end. The paths where XLA adds in float16 trade 1/N for a
    power of two with headroom (_xla.headroom_scales)."""
    if op == "sum":
        return 1.0, 1.0
    return (1.0 / size, 1.0) if cast else (1.0, 1.0 / size)
