// The reduced gradients written back to .grad, but where no rank used a
// parameter (Note [Used by no rank]).
#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "reducer/core/gradient_copy.h"
#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

BackwardUsage Reducer::conclude_usage() {
  std::vector<bool> globally_used; // empty: every parameter counts as used
  if (static_graph_.on()) {
    globally_used = static_graph_.used_globally();
  } else if (usage_.searches()) {
    globally_used = usage_.wait(gradients_stay_local_, &stall_);
  }
  return BackwardUsage(params_.size(), globally_used, drop_plan_);
}

void Reducer::write_back_gradients(const BackwardUsage& usage) {
  if (gradients_stay_local_) {
    return; // See Note [A world of one rank].
  }
  at::NoGradGuard no_grad;
  usage_.restore_stashed(params_, [&](size_t index) { return usage.used_by_no_rank(index); });
  for (auto& bucket : layout_.buckets()) {
    write_back_bucket(bucket, usage);
  }
}

void Reducer::write_back_bucket(Bucket& bucket, const BackwardUsage& usage) {
  if (gradients_stay_local_ || bucket.dropped) {
    return; // See Note [A world of one rank] and Note [Layer dropping].
  }
  if (!bucket.sparse) {
    write_back_views(bucket.views, bucket.param_indices, usage, options_.gradient_as_bucket_view);
    return;
  }
  const size_t index = bucket.param_indices.front(); // a sparse bucket holds one
  if (!usage.used_by_no_rank(index)) {
    params_[index].mutable_grad() = std::move(bucket.sparse_grad);
    bucket.sparse_grad = at::Tensor();
  }
}

void Reducer::write_back_views(
    const std::vector<at::Tensor>& views, const std::vector<size_t>& param_indices,
    const BackwardUsage& usage, bool as_view) {
  at::NoGradGuard no_grad;
  for (size_t slot = 0; slot < param_indices.size(); ++slot) {
    const size_t index = param_indices[slot];
    if (usage.used_by_no_rank(index)) {
      continue; // No rank used it: .grad stays as the user left it.
    }
    write_back_view(views[slot], params_[index], params_[index].mutable_grad(), as_view);
  }
}

} // namespace ddp_ext::reducer
