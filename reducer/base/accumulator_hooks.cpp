#include "reducer/base/accumulator_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <utility>

namespace ddp_ext::reducer {

namespace {

class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(const AccumulatorHooks::OnReady& on_ready, size_t index)
      : on_ready_(on_ready), index_(index) {}

  // `inputs` holds the gradient handed to the accumulator; it is undefined
  // when autograd ran the accumulator with no gradient.
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& inputs) override {
    on_ready_(index_, !inputs.empty() && inputs[0].defined());
    return outputs;
  }

 private:
  AccumulatorHooks::OnReady on_ready_;
  size_t index_;
};

} // namespace

void AccumulatorHooks::install(
    const std::vector<at::Tensor>& params,
    const std::vector<std::string>& names,
    const OnReady& on_ready) {
  accumulators_.reserve(params.size());
  keys_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
    TORCH_CHECK(accumulator, "parameter ", names[i], " has no gradient accumulator");
    keys_.push_back(accumulator->add_post_hook(
        std::make_unique<GradientReadyHook>(on_ready, i)));
    accumulators_.push_back(std::move(accumulator));
  }
}

void AccumulatorHooks::remove() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(keys_[i]);
  }
  accumulators_.clear();
  keys_.clear();
}

} // namespace ddp_ext::reducer
