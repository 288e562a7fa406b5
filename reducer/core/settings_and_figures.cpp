// What the wrapper sets between iterations, and the figures it reads.
#include <c10/util/Exception.h>

#include <vector>

#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

int64_t Reducer::training_steps() const {
  const auto lock = lock_state(Access::kRead);
  return training_steps_;
}

Phase Reducer::phase() const {
  const auto lock = lock_state(Access::kRead);
  return phase_;
}

int64_t Reducer::iterations() const {
  const auto lock = lock_state(Access::kRead);
  return iterations_;
}

bool Reducer::unused_parameters_stable() const {
  const auto lock = lock_state(Access::kRead);
  return usage_.stable();
}

void Reducer::check_between_iterations(const char* what) const {
  TORCH_CHECK(
      phase_ != Phase::kReducing,
      "DistributedDataParallel on rank ", process_group_->getRank(), " cannot change its ",
      what, " while gradients are being reduced; change it between iterations");
}

void Reducer::set_overlap_with_backward(bool overlap) {
  const auto lock = lock_state(Access::kChange);
  check_between_iterations("overlap_with_backward");
  options_.overlap_with_backward = overlap;
}

at::Tensor Reducer::local_used_map() {
  const auto lock = lock_state(Access::kRead);
  return usage_.bitmap_copy();
}

} // namespace ddp_ext::reducer
