#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "reducer/base/accumulator_ptr.h"

namespace ddp_ext::reducer {

// Note [Reducer lifetime]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The wrapper (and so the reducer) may be freed while a backward pass it
// prepared is running, by a hook for example. The destructor removes the
// autograd hooks, so no later gradient reaches it; the callbacks queued on
// the autograd engine hold only a weak reference, and raise instead of
// touching a destroyed reducer.

// One post hook on the gradient accumulator of each parameter, calling
// `on_ready(index, gradient_arrived)` once the accumulator has run
// (`gradient_arrived` is false when autograd ran it with no gradient: an
// output the loss did not use). Not thread-safe: the reducer calls it under
// its lock.
class AccumulatorHooks {
 public:
  using OnReady = std::function<void(size_t index, bool gradient_arrived)>;

  AccumulatorHooks() = default;
  AccumulatorHooks(const AccumulatorHooks&) = delete;
  AccumulatorHooks& operator=(const AccumulatorHooks&) = delete;
  ~AccumulatorHooks() {
    remove();
  }

  // `names[i]` names params[i] in errors.
  void install(
      const std::vector<at::Tensor>& params,
      const std::vector<std::string>& names,
      const OnReady& on_ready);
  // Removes every hook installed (again: nothing).
  void remove();

  // The accumulators hooked (empty once removed), held so that autograd
  // keeps using the nodes the hooks are installed on.
  const std::vector<AccumulatorPtr>& accumulators() const {
    return accumulators_;
  }

 private:
  std::vector<AccumulatorPtr> accumulators_;
  std::vector<uintptr_t> keys_; // to remove each hook
};

} // namespace ddp_ext::reducer
