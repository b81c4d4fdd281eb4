// codes(): what both extension modules (jaxcomm._ffi, jaxcomm._ffi_cuda)
// export so that Python takes every integer code from the C++ enums instead
// of spelling them again.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "common/algorithm_code.h"
#include "common/codes.h"
#include "common/dtype.h"

namespace jaxcomm {

template <typename E, size_t N>
pybind11::dict CodeDict(const NamedCode<E> (&table)[N]) {
  pybind11::dict d;
  for (const NamedCode<E>& c : table) d[c.name] = static_cast<int64_t>(c.code);
  return d;
}

// {"dtype": {"float32": 0, ...}, "algorithm": {...}, "unselected": {...},
//  "op": {...}}
inline pybind11::dict Codes() {
  pybind11::dict d;
  d["dtype"] = CodeDict(kDTypeNames);
  d["algorithm"] = CodeDict(kAlgorithmNames);
  d["unselected"] = CodeDict(kUnselectedNames);
  d["op"] = CodeDict(kOpTagNames);
  return d;
}

inline void DefineCodes(pybind11::module_& m) {
  m.def("codes", &Codes,
        "The integer codes the handlers take, from the C++ enums: "
        "{'dtype', 'algorithm', 'unselected', 'op'} -> {name: code}.");
}

}  // namespace jaxcomm
