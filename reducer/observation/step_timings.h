#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "reducer/observation/observer.h"
#include "reducer/observation/runtime_times.h"

namespace ddp_ext::reducer {

// Note [Stragglers]
// ~~~~~~~~~~~~~~~~~
// A rank slower than the others makes them wait in their collectives,
// where nobody sees why. Each rank measures, per synchronising iteration,
// three timings from the instants of Note [Runtime statistics]: the data
// wait (the end of the last backward's collectives to the next forward),
// the forward, and the backward's computation (the forward's end to the
// last gradient: before any wait for a collective, so a rank that only waits
// for a slow peer does not look slow). Every `every` training steps each
// rank writes its means over the steps since, in microseconds, into slots
// of its own in the step check (Note [Ranks out of step]), which runs
// anyway: every rank then holds every rank's figures, and
// ddp_ext/_diagnosis/stragglers.py compares them. every <= 0: off.

// An observer of the reducer (Note [Reducer observers]): a clock read at
// some turning points of an iteration, none in the per-gradient hook; it
// keeps the instants of Note [Runtime statistics] and the sums of Note
// [Stragglers]. Guarded by the reducer's mutex.
class StepTimings : public ReducerObserver {
 public:
  static constexpr int kTimings = 3; // data wait, forward, backward

  void on_forward() override {
    times_.forward_start = RuntimeTimes::now();
  }
  void on_backward_armed() override {
    times_.backward_compute_start = RuntimeTimes::now();
    times_.backward_comm_start = times_.backward_compute_end = times_.backward_comm_end = 0;
  }
  void on_bucket_launch(size_t) override {
    if (times_.backward_comm_start == 0) {
      times_.backward_comm_start = RuntimeTimes::now();
    }
  }
  void on_gradients_done() override {
    times_.backward_compute_end = RuntimeTimes::now();
  }
  // Every bucket was awaited: the iteration's timings count.
  void on_collectives_done() override;

  void set_every(int64_t every) {
    every_ = every;
  }
  // The kTimings means to publish in the backward check of `training_step`
  // (and the sums restart), or null when it is not an exchange step.
  const int64_t* to_publish(int64_t training_step);
  // Every rank's figures, as the step check of `step` brought them.
  void received(int64_t step, const std::vector<int64_t>& figures) {
    step_ = step;
    figures_ = figures;
  }

  const RuntimeTimes& times() const {
    return times_;
  }
  std::pair<int64_t, std::vector<int64_t>> figures() const {
    return {step_, figures_};
  }

 private:
  RuntimeTimes times_;
  int64_t every_ = 0;
  int64_t sums_[kTimings] = {0, 0, 0};
  int64_t count_ = 0;
  int64_t means_[kTimings] = {0, 0, 0};
  int64_t last_comm_end_ = 0;
  int64_t step_ = 0;
  std::vector<int64_t> figures_;
};

} // namespace ddp_ext::reducer
