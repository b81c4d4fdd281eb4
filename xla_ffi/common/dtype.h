// Element types the collectives accept, and exact round-to-nearest-even
// conversions for the two 16-bit wire formats.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/codes.h"

namespace jaxcomm {

// The codes of the `wire_dtype` attribute; Python reads them from codes()
// (common/python_codes.h).
enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };
inline constexpr NamedCode<DType> kDTypeNames[] = {
    {DType::kF32, "float32"},
    {DType::kF16, "float16"},
    {DType::kBF16, "bfloat16"},
    {DType::kF64, "float64"},
};

inline size_t SizeOf(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kF64:
      return 8;
  }
  return 0;
}

// The largest finite value of `t`, as a double.
inline double MaxFinite(DType t) {
  switch (t) {
    case DType::kF32:
      return 3.4028234663852886e38;
    case DType::kF16:
      return 65504.0;
    case DType::kBF16:
      return 3.3895313892515355e38;
    case DType::kF64:
      return 1.7976931348623157e308;
  }
  return 0.0;
}

inline bool IsValidDType(int32_t code) { return IsNamedCode(kDTypeNames, code); }

// Values are summed in float32, or float64 for float64 inputs: the wire format
// only decides what travels, never what precision the adds use.
inline DType AccumulatorFor(DType input) {
  return input == DType::kF64 ? DType::kF64 : DType::kF32;
}

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 -> binary32, exact.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf, nan
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24 is exact in float32.
  const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

// binary32 -> binary16 with round-to-nearest-even; overflow gives inf.
inline uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // nan stays a (quiet) nan
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                        // below 2^-14: subnormal half
    // Scale so one half-subnormal ulp is 1.0 and let the FPU round (RNE).
    const float scaled = BitsFloat(a) * 16777216.0f;  // * 2^24, exact
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits.
  const uint32_t odd = (a >> 13) & 1u;
  return sign | static_cast<uint16_t>((a - 0x38000000u + 0xfffu + odd) >> 13);
}

inline float BFloatToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

inline uint16_t FloatToBFloat(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t odd = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7fffu + odd) >> 16);
}

}  // namespace jaxcomm
