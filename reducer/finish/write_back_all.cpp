// torch's end of a backward: every bucket awaited, then every gradient written back.
#include "reducer/finish/end_of_backward.h"

namespace ddp_ext::reducer {

std::exception_ptr WriteBackAll::finish(ReducedBuckets& buckets) {
  {
    TimelineRange wait_range(buckets.timeline(), TimelineEvent::kWaitForBuckets);
    buckets.wait_for_all();
  }
  buckets.collectives_done();
  buckets.write_back_all();
  return nullptr;
}

} // namespace ddp_ext::reducer
