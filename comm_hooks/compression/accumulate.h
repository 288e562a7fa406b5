#pragma once

#include <ATen/core/Tensor.h>

namespace ddp_ext::compression {

// owed += scale * grad, in one pass over both (1-D, contiguous, float32 for
// the fast path); returns the sum of the squares of grad, the statistic the
// decisions need (Note [Adaptive precision]), from the same pass.
double accumulate_scaled(at::Tensor& owed, const at::Tensor& grad, double scale);

// The sum of the squares of `values` (any floating dtype), in double.
double squared_norm(const at::Tensor& values);

} // namespace ddp_ext::compression
