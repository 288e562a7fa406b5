// The reducer's side of hang attribution: what it reports about itself and
// when; the handler runs in a window without the reducer's lock (Note
// [Windows without the lock] in reducer/core/state_lock.cpp). See Note [Hang
// attribution] in reducer/observation/stall_watch.h.
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <utility>

#include "reducer/base/errors.h"
#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

void Reducer::set_stall_handler(
    int64_t timeout_ms, std::function<void(const StallReport&)> handler) {
  const auto lock = lock_state(Access::kChange);
  if (!handler) {
    stall_.configure(0, nullptr);
    return;
  }
  // The watch is a member: the lambda never outlives `this`. Every caller of
  // the watch changes the reducer: it holds the mutex, or waits in a window of
  // its own where no other thread changes anything (Note [Windows without
  // the lock]), so the report reads a state that holds still.
  stall_.configure(timeout_ms, [this, handler = std::move(handler)](const StallEvent& event) {
    const StallReport report = stall_report(event);
    UnlockedWindow window(*this, "its own hang report (a warning hook or filter)");
    handler(report);
  });
}

StallReport Reducer::stall_report(const StallEvent& event) const {
  StallReport report;
  report.event = event;
  report.rank = process_group_->getRank();
  report.step = backward_step_;
  report.training_steps = training_steps_;
  report.phase = phase_name(phase_);
  report.buckets_launched = static_cast<int64_t>(next_bucket_);
  report.buckets_total = static_cast<int64_t>(layout_.buckets().size());
  if (phase_ == Phase::kReducing) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!ready_[i]) {
        report.unready.push_back(param_names_[i]);
        report.unready_buckets.push_back(static_cast<int64_t>(layout_.bucket_index_of(i)));
      }
    }
  }
  return report;
}

void Reducer::watch_backward_end() {
  torch::autograd::Engine::get_default_engine().queue_callback(
      [weak = weak_from_this()] {
        if (const std::shared_ptr<Reducer> self = weak.lock()) {
          self->check_backward_ended();
        }
      });
}

void Reducer::check_backward_ended() {
  const auto lock = lock_state(Access::kChange);
  if (phase_ == Phase::kReducing && !static_graph_.learning() &&
      next_bucket_ < layout_.buckets().size() && !reported_unfinished_) {
    reported_unfinished_ = true;
    stall_.report(StallEvent::kUnfinished);
  }
}

std::string Reducer::unfinished_reduction_message() const {
  return ddp_ext::reducer::unfinished_reduction_message(
      process_group_->getRank(), backward_step_, next_bucket_ == layout_.buckets().size(),
      usage_.searches(), param_names_, ready_);
}

void Reducer::raise_unfinished_reduction() {
  const std::string message = unfinished_reduction_message();
  if (next_bucket_ < layout_.buckets().size()) {
    stall_.report(StallEvent::kAbandoned); // proof: see Note [Hang attribution]
  }
  reported_unfinished_ = false;
  // Raise without waiting for the buckets already launched: when ranks
  // skipped different parameters, some of those allreduces have no partner
  // and waiting would hang this rank instead of telling its user. A caller
  // that catches this and goes on waits for them in prepare_for_backward.
  enter(Phase::kReducing, Phase::kIdle);
  TORCH_CHECK(false, message);
}

} // namespace ddp_ext::reducer
