// The reducer's choice of its end-of-backward strategy (Note [The end of a
// backward]), and what it asks of the buckets one left on the wire.
#include <c10/util/Exception.h>

#include <memory>
#include <utility>

#include "reducer/core/buckets_of_backward.h"
#include "reducer/core/reducer.h"
#include "reducer/finish/step_and_defer_tail.h"
#include "reducer/finish/step_per_bucket.h"

namespace ddp_ext::reducer {

namespace {
const StepAndDeferTail* as_tail(const EndOfBackward& end) {
  return dynamic_cast<const StepAndDeferTail*>(&end);
}
} // namespace

void Reducer::set_bucket_step(BucketStep step) {
  std::unique_ptr<EndOfBackward> previous; // released after the lock: it may hold Python objects
  const auto lock = lock_state(Access::kChange);
  check_between_iterations("bucket step");
  check_nothing_deferred("a change of its bucket step");
  std::unique_ptr<EndOfBackward> next;
  if (!step) {
    next = std::make_unique<WriteBackAll>();
  } else if (const auto* tail = as_tail(*end_of_backward_)) {
    next = std::make_unique<StepAndDeferTail>(std::move(step), tail->fraction());
  } else {
    next = std::make_unique<StepPerBucket>(std::move(step));
  }
  previous = std::exchange(end_of_backward_, std::move(next));
}

void Reducer::set_forward_tail(double fraction) {
  std::unique_ptr<EndOfBackward> previous; // released after the lock, as above
  const auto lock = lock_state(Access::kChange);
  TORCH_CHECK(
      fraction >= 0 && fraction < 1,
      "the forward tail is a fraction of the gradient bytes in [0, 1), not ", fraction);
  check_between_iterations("forward tail");
  const BucketStep* step = end_of_backward_->step();
  if (fraction == 0 && (step == nullptr || !as_tail(*end_of_backward_))) {
    return; // no tail to remove
  }
  const int rank = process_group_->getRank();
  TORCH_CHECK(
      step != nullptr, "DistributedDataParallel on rank ", rank,
      " holds buckets for the next forward only when it steps them in the backward; "
      "set a bucket step first (overlap_optimizer)");
  TORCH_CHECK(
      !drops_layers_ && !options_.gradient_as_bucket_view,
      "DistributedDataParallel on rank ", rank, " cannot hold buckets for the next forward ",
      drops_layers_ ? "with layers dropped" : "with gradient_as_bucket_view=True",
      " (see Note [The next forward's buckets first])");
  check_nothing_deferred("a change of its forward tail");
  std::unique_ptr<EndOfBackward> next;
  if (fraction == 0) {
    next = std::make_unique<StepPerBucket>(*step);
  } else {
    next = std::make_unique<StepAndDeferTail>(*step, fraction);
  }
  previous = std::exchange(end_of_backward_, std::move(next));
}

bool Reducer::may_hold_buckets() const {
  return !transport_->runs_hook() && !gradients_stay_local_ && options_.overlap_with_backward &&
      !static_graph_.learning();
}

std::vector<std::pair<size_t, std::vector<size_t>>> Reducer::deferred_buckets() const {
  const auto lock = lock_state(Access::kRead);
  return end_of_backward_->deferred();
}

void Reducer::finish_deferred(size_t bucket_index) {
  const auto lock = lock_state(Access::kChange);
  BucketsOfBackward buckets(*this);
  end_of_backward_->finish_deferred(bucket_index, buckets);
}

void Reducer::check_nothing_deferred(const char* what) const {
  const size_t deferred = end_of_backward_->deferred_count();
  TORCH_CHECK(
      deferred == 0,
      "DistributedDataParallel on rank ", process_group_->getRank(), " cannot start ", what,
      " while ", deferred, " bucket(s) of the last backward are still being "
      "reduced for the forward overlap; finish them first (ddp.finish_forward_tail())");
}

} // namespace ddp_ext::reducer
