#include "reducer/base/averaging.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

namespace ddp_ext::reducer {

Averaging::Averaging(int64_t ranks) {
  set_ranks(ranks);
}

void Averaging::set_ranks(int64_t ranks) {
  TORCH_CHECK(ranks > 0, "cannot average gradients over ", ranks, " ranks");
  if (factor_.defined() && ranks == ranks_) {
    return; // Called every iteration: no new scalar unless Join changed it.
  }
  ranks_ = ranks;
  factor_ = c10::scalar_to_tensor(at::Scalar(1.0 / ranks));
  factor_.unsafeGetTensorImpl()->set_wrapped_number(true);
}

void Averaging::set_forward_pass_work(
    c10::intrusive_ptr<c10d::Work> work, bool divide_by_initial_world_size) {
  work_ = std::move(work);
  divide_by_initial_world_size_ = divide_by_initial_world_size;
}

void Averaging::take(int64_t world_size) {
  int64_t ranks = world_size;
  if (work_ && !divide_by_initial_world_size_) {
    work_->wait();
    const auto counted = work_->result();
    TORCH_INTERNAL_ASSERT(!counted.empty());
    ranks = std::llround(counted.front().cpu().item<double>());
  }
  work_.reset();
  set_ranks(ranks);
}

} // namespace ddp_ext::reducer
