// Stepping per bucket, with the first layers' buckets left to the next forward.
#include <c10/util/Exception.h>

#include "reducer/finish/step_and_defer_tail.h"

namespace ddp_ext::reducer {

StepAndDeferTail::StepAndDeferTail(BucketStep step, double fraction)
    : StepPerBucket(std::move(step)), fraction_(fraction) {
  TORCH_CHECK(
      fraction >= 0 && fraction < 1,
      "the forward tail is a fraction of the gradient bytes in [0, 1), not ", fraction);
}

void StepAndDeferTail::arm(const std::vector<Bucket>& buckets, bool may_hold) {
  const size_t none = buckets.size();
  held_from_ = none;
  if (!may_hold || fraction_ <= 0) {
    return;
  }
  double total = 0;
  for (const auto& bucket : buckets) {
    total += static_cast<double>(bucket.flat.nbytes());
  }
  double held = 0;
  while (held_from_ > 1 && held < fraction_ * total) { // never bucket 0
    const Bucket& bucket = buckets[held_from_ - 1];
    if (bucket.sparse) {
      break;
    }
    held += static_cast<double>(bucket.flat.nbytes());
    --held_from_;
  }
}

std::exception_ptr StepAndDeferTail::finish(ReducedBuckets& buckets) {
  TimelineRange wait_range(buckets.timeline(), TimelineEvent::kWaitForBuckets);
  const BackwardUsage& usage = buckets.usage();
  // The held buckets stay on the wire, unless restoring stashes waited for
  // them already.
  const bool stashed = buckets.restore_stashed();
  const size_t launched = buckets.launched();
  const size_t deferred_from = stashed ? launched : std::min(held_from_, launched);
  for (size_t b = launched; b-- > deferred_from;) {
    deferred_.push_back(buckets.leave_on_wire(b));
  }
  if (!deferred_.empty()) {
    usage_ = usage;
  }
  const std::exception_ptr failed = step_through(buckets, deferred_from);
  buckets.collectives_done();
  return failed;
}

std::vector<std::pair<size_t, std::vector<size_t>>> StepAndDeferTail::deferred() const {
  std::vector<std::pair<size_t, std::vector<size_t>>> result;
  result.reserve(deferred_.size());
  for (const auto& deferred : deferred_) {
    result.emplace_back(deferred.index, deferred.param_indices);
  }
  return result;
}

void StepAndDeferTail::finish_deferred(size_t bucket_index, DeferredFinisher& finisher) {
  auto found = std::find_if(deferred_.begin(), deferred_.end(), [&](const DeferredBucket& d) {
    return d.index == bucket_index;
  });
  if (found == deferred_.end()) {
    return;
  }
  DeferredBucket deferred = std::move(*found);
  deferred_.erase(found);
  finisher.finish(deferred, usage_);
}

} // namespace ddp_ext::reducer
