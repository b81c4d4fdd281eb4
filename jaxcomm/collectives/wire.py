"""What travels: the wire dtype, checked once, and the scaling policy that
goes with it.

Every backend follows one contract: ``cast(x * prescale)`` travels, the
reduced value is multiplied by ``postscale`` and cast back. A narrow wire
(16, 8 or 4 bits) rounds float32 values, and float16 overflows where float32
does not, so a narrow wire always divides by N before the cast: a transform
that wants a sum reduces a mean and multiplies by N afterwards, in float32
(:meth:`Wire.collective_op`, :meth:`Wire.scales_back`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxcomm.collectives import _fp8, _quantized

DTYPES = (
    jnp.float16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float64,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.int8,
    jnp.int4,
)


def _names(dtypes) -> str:
    return ", ".join(np.dtype(d).name for d in dtypes)


@dataclasses.dataclass(frozen=True)
class Wire:
    """A checked wire dtype; build it with :meth:`Wire.of`.

    Attributes:
      dtype: the dtype that travels, or ``None`` for the input's own.
    """

    dtype: np.dtype | None = None

    @classmethod
    def of(cls, wire_dtype) -> Wire:
        """Checks `wire_dtype` (``None``, a dtype or its name, or a Wire).

        Examples:
          >>> from jaxcomm.collectives import Wire
          >>> Wire.of("bfloat16").narrow, Wire.of(None).narrow, Wire.of("int4").quantized
          (True, False, True)
          >>> Wire.of("int16")  # doctest: +ELLIPSIS
          Traceback (most recent call last):
          ...
          TypeError: wire_dtype=int16 is not supported; use None or one of float16, ...
        """
        if isinstance(wire_dtype, Wire):
            return wire_dtype
        if wire_dtype is None:
            return cls(None)
        try:
            dtype = np.dtype(wire_dtype)
        except TypeError as e:
            raise TypeError(
                f"wire_dtype={wire_dtype!r} is not a dtype; use None or one of {_names(DTYPES)}"
            ) from e
        if dtype not in [np.dtype(d) for d in DTYPES]:
            raise TypeError(
                f"wire_dtype={dtype.name} is not supported; use None or one of {_names(DTYPES)}"
            )
        return cls(dtype)

    @property
    def name(self) -> str | None:
        return None if self.dtype is None else self.dtype.name

    @property
    def narrow(self) -> bool:
        """A 16-, 8- or 4-bit wire: it rounds float32 values (what error feedback keeps)."""
        return self.dtype is not None and self.dtype.itemsize < 4

    def check_error_feedback(self, error_feedback, *, encoded: bool = False, given=None) -> None:
        """Raises ValueError where `error_feedback` is asked of a wire that is
        not narrow: error feedback keeps what the wire's rounding drops, and
        a wider wire drops nothing.

        Args:
          error_feedback: the transform's option.
          encoded: the wire carries an encoded difference (diloco's outer
            step), named in the message as `given`, the wire_dtype passed.

        Examples:
          >>> from jaxcomm.collectives import Wire
          >>> Wire.of("bfloat16").check_error_feedback(True)
          >>> Wire.of(None).check_error_feedback(True)  # doctest: +ELLIPSIS
          Traceback (most recent call last):
          ...
          ValueError: error_feedback=True keeps what a narrow wire cast drops; ... got None
        """
        if not error_feedback or self.narrow:
            return
        if encoded:
            raise ValueError(
                "error_feedback=True keeps what a narrow wire's encoding drops; with "
                f"wire_dtype={given!r} nothing is dropped. Pass a 16- or 8-bit float "
                "or an integer wire_dtype, or leave error_feedback off"
            )
        raise ValueError(
            "error_feedback=True keeps what a narrow wire cast drops; "
            "it needs a narrow wire_dtype (float16, bfloat16, float8_e4m3fn, float8_e5m2, "
            f"int8 or int4), got {self.name}"
        )

    @property
    def fp8(self) -> bool:
        """An 8-bit float wire, scaled per device and part (see _fp8.py)."""
        return self.dtype is not None and self.dtype in _fp8.WIRES

    @property
    def quantized(self) -> bool:
        """An int8 or int4 wire, scaled per device and chunk (see _quantized.py)."""
        return self.dtype is not None and self.dtype in _quantized.WIRES

    @property
    def scaled(self) -> bool:
        """A wire with scales of its own (FP8, int8, int4): it runs the
        all-to-all schedule of backend='xla', which adds in float32."""
        return self.fp8 or self.quantized

    @property
    def can_start(self) -> bool:
        """A wire jaxcomm's handlers cast themselves (none, 16-bit floats), so
        an allreduce over it can start in one step and finish in a later one."""
        return not self.scaled

    def payload_bytes(self, elements: int, dtype, size: int, parts: int = 1) -> int:
        """Bytes a device puts into an allreduce of `elements` of `dtype` in
        `parts` parts over `size` devices, counted so that 2(N-1)/N of it is
        what it sends: the wire's bytes, and a scaled wire's scales."""
        if self.quantized:
            scale = np.dtype(_fp8._accumulator(dtype)).itemsize
            return _quantized.payload_bytes(elements, parts, size, self.dtype, scale)
        if self.fp8:  # rows padded to N equal ones, and the exponents
            return size * -(-elements // size) + _fp8.scale_bytes(size, parts)
        return elements * self.for_input(dtype).itemsize

    def exchange_bytes(self, elements: int, size: int, parts: int = 1) -> tuple[int, int]:
        """(all-to-all, all-gather) result bytes of an integer wire's
        allreduce of `elements` in `parts` parts over `size` devices, float32
        scales (what the cost model prices)."""
        if not self.quantized:
            raise ValueError(f"exchange_bytes is an integer wire's count, not {self.dtype}'s")
        return _quantized.exchange_bytes(elements, parts, size, self.dtype)

    def for_input(self, dtype) -> np.dtype:
        """The dtype that travels for an input of `dtype`."""
        return np.dtype(dtype) if self.dtype is None else self.dtype

    def scales(self, op: str, size: int, dtype) -> tuple[np.dtype, float, float]:
        """(wire dtype, prescale, postscale) for an input of `dtype` reduced
        over `size` devices. A mean whose input is cast divides before the
        cast, so large N cannot overflow float16; otherwise it divides at the
        end. The paths where XLA adds in float16 trade 1/N for a power of two
        with headroom (_xla.headroom_scales)."""
        wire = self.for_input(dtype)
        if op == "sum":
            return wire, 1.0, 1.0
        if wire != np.dtype(dtype):
            return wire, 1.0 / size, 1.0
        return wire, 1.0, 1.0 / size

    def collective_op(self, op: str) -> str:
        """The op a transform's collective runs for the transform's `op`: a
        narrow wire always reduces a mean (prescaled by 1/N before its cast)."""
        return "mean" if self.narrow else op

    def scales_back(self, op: str) -> bool:
        """Whether a transform asked for `op` multiplies the collective's mean
        by N afterwards (a sum over a narrow wire)."""
        return self.narrow and op == "sum"
