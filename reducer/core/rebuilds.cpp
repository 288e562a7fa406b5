// The reducer's side of the bucket layout's rebuilds (Note [Agreeing on the
// bucket layout] in reducer/layout/bucket_layout.h): the first at a forward,
// the later ones at the end of a backward, and new caps.
#include <c10/util/Exception.h>

#include <vector>

#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

bool Reducer::rebuild_buckets() {
  const auto lock = lock_state(Access::kChange);
  TORCH_CHECK(phase_ != Phase::kReducing, unfinished_reduction_message());
  if (phase_ == Phase::kIdle && layout_.order().first_rebuild_due()) {
    // Room for the rebuild's timeline range: a forward drained it.
    observers_.notify(
        &ReducerObserver::on_iteration_ahead, params_.size(), layout_.buckets().size());
  }
  const auto first = layout_.rebuild_first(*process_group_, timeline_, &stall_);
  if (first.changed) {
    next_bucket_ = 0;
    if (phase_ == Phase::kExpectingGradients) {
      arm_buckets(); // a forward already armed the old buckets
    }
  }
  return first.done;
}

void Reducer::arm_buckets() {
  for (auto& bucket : layout_.buckets()) {
    bucket.pending = bucket.param_indices.size();
    bucket.dropped = drop_plan_.drops_all(bucket.param_indices);
    bucket.filled_on.reset();
  }
  end_of_backward_->arm(layout_.buckets(), may_hold_buckets());
}

void Reducer::conclude_layout(bool launched_at_end) {
  // See Note [Agreeing on the bucket layout]: the step check was awaited
  // before the buckets (a world of one has none).
  if (layout_.conclude(launched_at_end, step_check_->summed_votes(), *process_group_, timeline_, &stall_)) {
    next_bucket_ = 0;
  }
}

bool Reducer::set_bucket_caps(const std::vector<int64_t>& caps) {
  const auto lock = lock_state(Access::kChange);
  check_between_iterations("bucket caps");
  // Safe for the reasons a rebuild is: nothing is in flight, and .grad views
  // move with the buckets.
  if (!layout_.set_caps(caps, timeline_)) {
    return false;
  }
  next_bucket_ = 0;
  if (phase_ == Phase::kExpectingGradients) {
    arm_buckets(); // a forward already armed the old buckets
  }
  return true;
}

} // namespace ddp_ext::reducer
