// The reducer's side of the step check: what every synchronising backward
// (and a forward that broadcasts buffers) makes the ranks agree on before
// their gradients are averaged. See Note [Ranks out of step] in
// reducer/agreement/step_check.h.
#include <c10/util/Exception.h>

#include <string>

#include "reducer/core/reducer.h"
#include "reducer/transport/allreduce.h"
#include "reducer/transport/carrier_with_step_check.h"

namespace ddp_ext::reducer {

void Reducer::reset_step_check() {
  step_check_.reset();
  if (process_group_->getSize() > 1) {
    step_check_.emplace(
        process_group_->getRank(), process_group_->getSize(),
        params_.front().device());
  }
  if (!transport_->runs_hook()) { // See Note [Bucket transports].
    transport_ = step_check_ ? std::shared_ptr<BucketTransport>(
                                   std::make_shared<CarrierWithStepCheck>(*step_check_))
                             : std::make_shared<Allreduce>();
  }
}

void Reducer::raise_if_out_of_step() {
  // See Note [Ranks out of step].
  if (!step_check_ || !step_check_->launched()) {
    return;
  }
  std::string message;
  {
    TimelineRange range(timeline_, TimelineEvent::kStepCheckWait);
    if (step_check_->riding()) {
      // See Note [The step check on bucket 0]: it arrives with bucket 0.
      Bucket& first = layout_.buckets().front();
      TORCH_INTERNAL_ASSERT(first.work, "the step check rides on bucket 0, which was not launched");
      transport_->finish(0, first, transport_context()); // unpacks bucket 0
      message = step_check_->read_ridden();
    } else {
      message = step_check_->wait(&stall_);
    }
  }
  if (message.empty()) {
    hook_unconfirmed_ = false; // See Note [Hooks registered after the first forward].
    if (!step_check_->timings().empty()) { // See Note [Stragglers].
      timings_.received(backward_step_, step_check_->timings());
    }
    return;
  }
  // A peer may have raised instead of reducing: drop this backward's
  // collectives rather than wait for partners that may never come.
  abandon_iteration();
  usage_.drop(/*clear=*/true);
  enter(phase_, Phase::kIdle);
  TORCH_CHECK(false, message);
}

bool Reducer::needs_own_step_check() const {
  // A hook registered late counts as none until a check confirmed it. The
  // same on every rank.
  return options_.buffers_broadcast || drops_layers_ ||
      options_.skip_all_reduce_unused_params || averaging_.under_join() ||
      (transport_->runs_hook() && !hook_unconfirmed_);
}

void Reducer::check_step_before_forward_collectives() {
  const auto lock = lock_state(Access::kChange);
  if (step_check_) {
    // See Note [The step check on bucket 0]: shaped like the checks a peer
    // out of step may run instead.
    const std::string message =
        rides_on_bucket0(layout_.buckets().front(), *process_group_, needs_own_step_check())
        ? step_check_->check_forward_shaped_like(
              *process_group_, layout_.buckets().front().flat, backwards_begun_, &stall_)
        : step_check_->check_forward(*process_group_, backwards_begun_, &stall_);
    TORCH_CHECK(message.empty(), message);
  }
}

void Reducer::match_step_check_as_joined() {
  const auto lock = lock_state(Access::kChange);
  if (step_check_) {
    step_check_->match_as_joined(*process_group_);
  }
}

void Reducer::set_comm_hook_fingerprint(int64_t fingerprint, bool confirm) {
  const auto lock = lock_state(Access::kChange);
  TORCH_CHECK(fingerprint > 0, "a communication hook fingerprint is positive");
  hook_fingerprint_ = fingerprint;
  hook_unconfirmed_ = hook_unconfirmed_ || confirm;
}

} // namespace ddp_ext::reducer
