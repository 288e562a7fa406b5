#include "reducer/observation/step_timings.h"

namespace ddp_ext::reducer {

void StepTimings::on_collectives_done() {
  times_.backward_comm_end = RuntimeTimes::now();
  const RuntimeTimes& t = times_;
  if (every_ > 0 && t.forward_start > 0 &&
      t.forward_start <= t.backward_compute_start &&
      t.backward_compute_start <= t.backward_compute_end) {
    sums_[0] += last_comm_end_ > 0 && t.forward_start > last_comm_end_
        ? t.forward_start - last_comm_end_ : 0;
    sums_[1] += t.backward_compute_start - t.forward_start;
    sums_[2] += t.backward_compute_end - t.backward_compute_start;
    ++count_;
  }
  last_comm_end_ = t.backward_comm_end;
}

const int64_t* StepTimings::to_publish(int64_t training_step) {
  if (every_ <= 0 || count_ == 0 || training_step % every_ != 0) {
    return nullptr;
  }
  for (int p = 0; p < kTimings; ++p) {
    means_[p] = sums_[p] / count_ / 1000 + 1; // microseconds; 0 means none
    sums_[p] = 0;
  }
  count_ = 0;
  return means_;
}

} // namespace ddp_ext::reducer
