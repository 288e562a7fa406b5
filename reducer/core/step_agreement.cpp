// The reducer's side of the step check: what every synchronising backward
// (and a forward that broadcasts buffers) makes the ranks agree on before
// their gradients are averaged. See Note [Ranks out of step] in
// reducer/agreement/step_check.h.
#include <c10/util/Exception.h>

#include <string>

#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

void Reducer::reset_step_check() {
  step_check_ = step_check_policy(*process_group_, params_.front().device());
  if (!transport_->runs_hook()) { // See Note [Bucket transports].
    transport_ = step_check_->transport_without_hook();
  } else {
    transport_->step_check_replaced(step_check_->transport_without_hook());
  }
}

void Reducer::raise_if_out_of_step() {
  // See Note [Ranks out of step].
  if (!step_check_->launched()) {
    return;
  }
  std::string message;
  {
    TimelineRange range(timeline_, TimelineEvent::kStepCheckWait);
    message = step_check_->await_backward(
        *transport_, layout_.buckets().front(), transport_context());
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
  // same on every rank, as is whether bucket 0 is replicated under sharding
  // (Note [The step check on a replicated bucket 0]).
  return options_.buffers_broadcast || drops_layers_ ||
      options_.skip_all_reduce_unused_params || averaging_.under_join() ||
      (!transport_->carries_step_check(layout_.buckets().front(), process_group_->getSize()) &&
       !hook_unconfirmed_);
}

void Reducer::check_step_before_forward_collectives() {
  const auto lock = lock_state(Access::kChange);
  const std::string message = step_check_->check_forward(
      *process_group_, layout_.buckets().front(), needs_own_step_check(), backwards_begun_,
      stall_);
  TORCH_CHECK(message.empty(), message);
}

void Reducer::match_step_check_as_joined() {
  const auto lock = lock_state(Access::kChange);
  step_check_->match_as_joined(*process_group_);
}

void Reducer::set_comm_hook_fingerprint(int64_t fingerprint, bool confirm) {
  const auto lock = lock_state(Access::kChange);
  TORCH_CHECK(fingerprint > 0, "a communication hook fingerprint is positive");
  hook_fingerprint_ = fingerprint;
  hook_unconfirmed_ = hook_unconfirmed_ || confirm;
}

} // namespace ddp_ext::reducer
