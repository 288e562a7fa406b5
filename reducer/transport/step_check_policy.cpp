// The two step check policies of Note [Step check policies].
#include "reducer/transport/step_check_policy.h"

#include <c10/util/Exception.h>

#include "reducer/transport/carrier_with_step_check.h"
#include "reducer/transport/no_step_check.h"
#include "reducer/transport/peer_step_check.h"

namespace ddp_ext::reducer {

std::unique_ptr<StepCheckPolicy> step_check_policy(
    const c10d::ProcessGroup& group, c10::Device device) {
  if (group.getSize() == 1) {
    return std::make_unique<NoStepCheck>();
  }
  return std::make_unique<PeerStepCheck>(group.getRank(), group.getSize(), device);
}

std::shared_ptr<BucketTransport> PeerStepCheck::transport_without_hook() {
  return std::make_shared<CarrierWithStepCheck>(check_);
}

bool PeerStepCheck::launch_backward(
    const Bucket& first, bool own_check, const BucketTransport& transport,
    const TransportContext& context, c10::function_ref<StepEntry()> entry) {
  // See Note [The step check on bucket 0].
  if (!rides_on_bucket0(first, context.group, own_check)) {
    check_.launch_backward(context.group, entry());
    context.observers.notify(&ReducerObserver::on_step_check_launched);
  } else if (transport.carries_step_check(first, context.group.getSize())) {
    // See Note [The step check on bucket 0]: launched with bucket 0.
    check_.ride_on_bucket0(entry(), first.flat.scalar_type());
  } else {
    // A hook registered after the first forward: shaped like the bucket 0
    // its peers may carry their checks on, awaited before any bucket.
    check_.launch_backward_shaped_like(context.group, first.flat, entry());
    context.observers.notify(&ReducerObserver::on_step_check_launched);
  }
  return true;
}

std::string PeerStepCheck::await_backward(
    BucketTransport& transport, Bucket& first, const TransportContext& context) {
  if (!check_.riding()) {
    return check_.wait(&context.stall);
  }
  // See Note [The step check on bucket 0]: it arrives with bucket 0.
  TORCH_INTERNAL_ASSERT(first.work, "the step check rides on bucket 0, which was not launched");
  transport.finish(0, first, context); // unpacks bucket 0
  return check_.read_ridden();
}

std::string PeerStepCheck::check_forward(
    c10d::ProcessGroup& group, const Bucket& first, bool own_check, int64_t backwards,
    StallWatch& watch) {
  // See Note [The step check on bucket 0]: shaped like the checks a peer
  // out of step may run instead.
  return rides_on_bucket0(first, group, own_check)
      ? check_.check_forward_shaped_like(group, first.flat, backwards, &watch)
      : check_.check_forward(group, backwards, &watch);
}

} // namespace ddp_ext::reducer
