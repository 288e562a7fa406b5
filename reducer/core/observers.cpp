// The reducer's side of its observers (Note [Reducer observers]): the
// settings and figures of the communication timeline (Note [Communication
// timeline]) and of the step timings (Note [Runtime statistics], Note
// [Stragglers]), under the reducer's lock.
#include <utility>
#include <vector>

#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

void Reducer::set_timeline(bool on) {
  const auto lock = lock_state(Access::kChange);
  timeline_.set_on(on);
  if (on) {
    // For a backward already prepared.
    timeline_.reserve_iteration(params_.size(), layout_.buckets().size());
  }
}

std::vector<TimelineEvent> Reducer::take_timeline(int64_t* dropped, int64_t wait_ms) {
  const auto lock = lock_state(Access::kChange);
  return timeline_.take(dropped, wait_ms);
}

void Reducer::set_straggler_every(int64_t every) {
  const auto lock = lock_state(Access::kChange);
  timings_.set_every(every);
}

std::pair<int64_t, std::vector<int64_t>> Reducer::straggler_figures() const {
  const auto lock = lock_state(Access::kRead);
  return timings_.figures();
}

RuntimeTimes Reducer::runtime_times() const {
  const auto lock = lock_state(Access::kRead);
  return timings_.times();
}

} // namespace ddp_ext::reducer
