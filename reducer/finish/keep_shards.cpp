// The shards kept, nothing written back: see keep_shards.h.
#include "reducer/finish/keep_shards.h"

namespace ddp_ext::reducer {

std::exception_ptr KeepShards::finish(ReducedBuckets& buckets) {
  {
    TimelineRange wait_range(buckets.timeline(), TimelineEvent::kWaitForBuckets);
    buckets.usage(); // which parameters no rank used, before handing any over
    for (size_t b = 0; b < buckets.launched(); ++b) {
      buckets.wait_for(b); // a no-op for a bucket finished at a later launch
    }
  }
  buckets.collectives_done();
  const BucketStep step = step_; // a copy: see Note [Windows without the lock]
  for (size_t b = 0; b < buckets.launched(); ++b) {
    try {
      buckets.step_used(step, b);
    } catch (...) {
      return std::current_exception();
    }
  }
  return nullptr;
}

} // namespace ddp_ext::reducer
