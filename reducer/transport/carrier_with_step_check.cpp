#include "reducer/transport/carrier_with_step_check.h"

namespace ddp_ext::reducer {

void CarrierWithStepCheck::launch(
    size_t index, size_t count, Bucket& bucket, const TransportContext& context,
    TimelineRange& range) {
  if (index != 0 || !check_.riding()) {
    Allreduce::launch(index, count, bucket, context, range);
    return;
  }
  // See Note [The step check on bucket 0]: the check leaves now.
  const at::Tensor& carrier = check_.carry(bucket.flat);
  context.observers.notify(&ReducerObserver::on_step_check_launched);
  start(bucket, carrier, context);
  record(index, bucket, bucket.flat, context, range);
}

void CarrierWithStepCheck::finish(size_t index, Bucket& bucket, const TransportContext& context) {
  if (index != 0 || !check_.riding() || !bucket.work) {
    Allreduce::finish(index, bucket, context);
    return;
  }
  // Gloo only (rides_on_bucket0): the Work itself is awaited.
  context.stall.wait(*bucket.work, "bucket", 0);
  context.timeline.awaited(0);
  bucket.work.reset();
  check_.unpack(bucket.flat);
}

} // namespace ddp_ext::reducer
