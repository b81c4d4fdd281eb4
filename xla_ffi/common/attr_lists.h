// The attributes several handlers share, each list written once. X(type,
// name) per attribute, `type` as the handler decodes it: the structs that
// decode them (common/ffi_bindings.h) and the names the extension modules
// export to Python (common/python_codes.h) both expand these lists, so a
// name added here reaches every handler that takes the list and the test
// that checks Python passes it (tests/test_ffi_codes.py).
#pragma once

// The schedule and wire of a reducing call: allreduce, allreduce_parts and
// allreduce_start.
#define JAXCOMM_REDUCTION_ATTRS(X)                          \
  X(int32_t, algorithm)  /* Algorithm code */               \
  X(int32_t, nranks)     /* ranks on the reduced axes */    \
  X(int32_t, intra_size) /* hierarchical: ranks per node */ \
  X(int32_t, wire_dtype) /* DType code, -1 = input dtype */ \
  X(double, prescale)    /* before the wire cast */         \
  X(double, postscale)   /* after the reduction */

// allreduce's chunk mask.
#define JAXCOMM_CHUNK_MASK_ATTRS(X)                        \
  X(int64_t, chunk_size) /* mask granularity, elements */  \
  X(int64_t, max_chunks) /* chunk slots packed, 0 = all */ \
  X(int32_t, unselected) /* Unselected code: local or zeros */

// A list expanded into a struct's fields.
#define JAXCOMM_ATTR_FIELD(type, name) type name;
