// The learning iteration of a static graph, as the reducer runs it (Note
// [Static graph] in reducer/participation/static_graph.h).
#include <c10/util/Exception.h>

#include <exception>
#include <vector>

#include "reducer/core/buckets_of_backward.h"
#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

void Reducer::set_static_graph() {
  const auto lock = lock_state(Access::kChange);
  static_graph_.enable(iterations_);
  layout_.order().set_first_rebuild(true, /*skipped_backwards=*/1); // the learning one
}

bool Reducer::learning_static_graph() const {
  const auto lock = lock_state(Access::kRead);
  return static_graph_.learning();
}

void Reducer::queue_finish_learning_iteration() {
  {
    const auto lock = lock_state(Access::kRead);
    if (!static_graph_.learning()) {
      return;
    }
  }
  queue_at_end_of_backward(&Reducer::finish_learning_iteration);
}

void Reducer::finish_learning_iteration() {
  const auto lock = lock_state(Access::kChange);
  if (!static_graph_.learning()) {
    return; // Another output sink of the same iteration finished it.
  }
  if (phase_ == Phase::kExpectingGradients) {
    start_reducing();
  }
  TORCH_INTERNAL_ASSERT(phase_ == Phase::kReducing);
  TimelineRange range(timeline_, TimelineEvent::kFinalize);
  observers_.notify(&ReducerObserver::on_gradients_done);
  const std::vector<bool> used_locally = usage_.used_locally();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) {
      mark_ready(i);
    }
  }
  launch_all_buckets();
  if (!gradients_stay_local_) {
    usage_.launch_allreduce(*process_group_);
  }
  raise_if_out_of_step();
  {
    TimelineRange wait_range(timeline_, TimelineEvent::kWaitForBuckets);
    wait_for_launched_buckets();
  }
  observers_.notify(&ReducerObserver::on_collectives_done);
  static_graph_.learned_from(used_locally, usage_.wait(gradients_stay_local_, &stall_));
  std::exception_ptr failed;
  if (end_of_backward_->ends_learning_iteration()) {
    BucketsOfBackward buckets(*this); // See Note [Sharded buckets].
    failed = end_of_backward_->finish(buckets);
  } else {
    write_back_gradients(BackwardUsage(params_.size(), static_graph_.used_globally(), drop_plan_));
  }
  conclude_layout(/*launched_at_end=*/true);
  enter(Phase::kReducing, Phase::kIdle);
  if (failed) {
    std::rethrow_exception(failed);
  }
}

} // namespace ddp_ext::reducer
