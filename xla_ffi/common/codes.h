// The integer codes of the FFI attributes (and the CPU rendezvous' op tags),
// each enum with the names Python knows its values by: jaxcomm._ffi.codes()
// and jaxcomm._ffi_cuda.codes() are built from these tables
// (common/python_codes.h), and Python reads its codes from there.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jaxcomm {

template <typename E>
struct NamedCode {
  E code;
  const char* name;
};

// Whether `code` is one of `table`'s values: an attribute is checked against
// the same table that names it.
template <typename E, size_t N>
constexpr bool IsNamedCode(const NamedCode<E> (&table)[N], int32_t code) {
  for (const NamedCode<E>& c : table) {
    if (static_cast<int64_t>(c.code) == code) return true;
  }
  return false;
}

// What a masked allreduce leaves in the chunks it does not reduce: the local
// input, or zeros (the `unselected` attribute).
enum class Unselected : int32_t { kLocal = 0, kZero = 1 };
inline constexpr NamedCode<Unselected> kUnselectedNames[] = {
    {Unselected::kLocal, "local"},
    {Unselected::kZero, "zero"},
};

// The first word of a CPU call's fingerprint: which collective it is, so that
// ranks that reach one rendezvous slot through different collectives (op ids
// that disagree across processes) differ whatever their sizes.
enum class OpTag : int64_t {
  kAllReduce = 1,
  kReduceScatter = 2,
  kAllGather = 3,
  kAllReduceParts = 4,
  kAllReduceStart = 5,
};
inline constexpr NamedCode<OpTag> kOpTagNames[] = {
    {OpTag::kAllReduce, "allreduce"},
    {OpTag::kReduceScatter, "reduce_scatter"},
    {OpTag::kAllGather, "all_gather"},
    {OpTag::kAllReduceParts, "allreduce_parts"},
    {OpTag::kAllReduceStart, "allreduce_start"},
};

}  // namespace jaxcomm
