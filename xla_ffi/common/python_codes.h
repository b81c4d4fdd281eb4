// codes() and attributes(): what both extension modules (jaxcomm._ffi,
// jaxcomm._ffi_cuda) export so that Python takes every integer code from the
// C++ enums instead of spelling them again, and a test can check that Python
// passes the attributes the handlers decode.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "common/algorithm_code.h"
#include "common/attr_lists.h"
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

// {"reduction": {name: C++ type}, "chunk_mask": {...}}: the attribute lists
// several handlers decode (common/attr_lists.h), in their order.
struct AttrEntry {
  const char* name;
  const char* type;
};

template <size_t N>
pybind11::dict AttrDict(const AttrEntry (&entries)[N]) {
  pybind11::dict d;
  for (const AttrEntry& e : entries) d[e.name] = e.type;
  return d;
}

#define JAXCOMM_ATTR_ENTRY(type, name) {#name, #type},

inline pybind11::dict AttributeLists() {
  const AttrEntry reduction[] = {JAXCOMM_REDUCTION_ATTRS(JAXCOMM_ATTR_ENTRY)};
  const AttrEntry chunk_mask[] = {JAXCOMM_CHUNK_MASK_ATTRS(JAXCOMM_ATTR_ENTRY)};
  pybind11::dict d;
  d["reduction"] = AttrDict(reduction);
  d["chunk_mask"] = AttrDict(chunk_mask);
  return d;
}

#undef JAXCOMM_ATTR_ENTRY

inline void DefineCodes(pybind11::module_& m) {
  m.def("codes", &Codes,
        "The integer codes the handlers take, from the C++ enums: "
        "{'dtype', 'algorithm', 'unselected', 'op'} -> {name: code}.");
  m.def("attributes", &AttributeLists,
        "The attribute lists several handlers decode, from the C++ lists: "
        "{'reduction', 'chunk_mask'} -> {name: C++ type}.");
}

}  // namespace jaxcomm
