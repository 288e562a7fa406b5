#pragma once

#include <chrono>
#include <cstdint>

namespace ddp_ext::reducer {

// Note [Runtime statistics]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// torch's DDP logger reports, on sampled iterations, forward_compute_time,
// backward_compute_time, backward_comm_time and
// backward_compute_comm_overlap_time from five host-side instants of the
// last synchronising iteration. The reducer records the same instants, in
// steady-clock nanoseconds (time.monotonic_ns's clock), every iteration:
// five clock reads, none in the per-gradient hook. ddp_ext/_logging_data.py
// samples them at the next synchronising forward, as torch's logger does.
//
//   forward_start           prepare_for_forward (a forward with gradients)
//   backward_compute_start  prepare_for_backward (the forward's end)
//   backward_comm_start     the first bucket launched
//   backward_compute_end    finalize: every gradient has arrived
//   backward_comm_end       finalize: every bucket was awaited
//
// So compute = compute_end - compute_start, comm = comm_end - comm_start and
// overlap = compute_end - comm_start never exceeds either.
struct RuntimeTimes {
  int64_t forward_start = 0;
  int64_t backward_compute_start = 0;
  int64_t backward_comm_start = 0;
  int64_t backward_compute_end = 0;
  int64_t backward_comm_end = 0;

  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

} // namespace ddp_ext::reducer
