// The types and scales of one reduction: what the FFI contract decodes from a
// call's operands and attributes, and what the schedules run on.
#pragma once

#include "common/dtype.h"

namespace jaxcomm {

struct ReduceSpec {
  DType input;             // dtype of input and output
  DType wire;              // dtype that travels
  double prescale = 1.0;   // applied before the cast to the wire type
  double postscale = 1.0;  // applied to the reduced value before the output cast
  DType acc() const { return AccumulatorFor(input); }
  // A prescaled reduction is a mean: its exact value, and every partial sum,
  // lies within the wire type's range whenever the inputs do, so an overflow
  // on the wire can only come from rounding up by part of an ulp. Such sums
  // are clamped to the largest finite wire value instead of becoming inf. A
  // plain sum is not clamped: its overflow is real.
  bool saturate() const { return prescale != 1.0; }
};

}  // namespace jaxcomm
