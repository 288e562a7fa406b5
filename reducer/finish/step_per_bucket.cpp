// Stepping each bucket's parameters as soon as the bucket is reduced.
#include "reducer/finish/step_per_bucket.h"

namespace ddp_ext::reducer {

std::exception_ptr StepPerBucket::finish(ReducedBuckets& buckets) {
  TimelineRange wait_range(buckets.timeline(), TimelineEvent::kWaitForBuckets);
  buckets.usage(); // before any write-back: Note [Stepping reduced buckets]
  buckets.restore_stashed();
  const std::exception_ptr failed = step_through(buckets, buckets.launched());
  buckets.collectives_done();
  return failed;
}

std::exception_ptr StepPerBucket::step_through(ReducedBuckets& buckets, size_t end) const {
  const BucketStep step = step_; // a copy: see Note [Windows without the lock]
  std::exception_ptr failed;
  for (size_t b = 0; b < end; ++b) {
    buckets.wait_for(b); // a no-op for a bucket awaited already
    buckets.write_back(b);
    if (failed) {
      continue;
    }
    try {
      buckets.step(step, b);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  return failed;
}

} // namespace ddp_ext::reducer
