#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>

namespace ddp_ext::reducer {

// Note [Gradient accumulator pointer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch::autograd::impl::grad_accumulator returns a std::shared_ptr<Node> up
// to torch 2.11 and a c10::intrusive_ptr<Node> in newer torch. We hold the
// accumulators with whichever type the torch we build against returns; both
// have get(), all the code uses besides holding them.
using AccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(
    std::declval<const at::Tensor&>()));

} // namespace ddp_ext::reducer
