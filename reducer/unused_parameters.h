#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>

#include <cstddef>
#include <vector>

#include "reducer/accumulator_ptr.h"

namespace ddp_ext::reducer {

// Indices of the gradient accumulators that no path of the autograd graph
// reaches from `outputs`: the parameters the forward did not use.
// See Note [Unused parameters].
std::vector<size_t> find_unreached_accumulators(
    const std::vector<at::Tensor>& outputs,
    const std::vector<AccumulatorPtr>& accumulators);

} // namespace ddp_ext::reducer
