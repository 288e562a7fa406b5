#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ddp_ext::reducer {

// Note [Hang attribution]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A collective whose partner never comes waits until the process group's
// timeout (30 minutes by default), then says only that a transport timed out.
// The usual cause is a parameter that got no gradient on some ranks: their
// bucket is never launched there, while the ranks that did compute it wait
// for its allreduce at the end of their backward.
//
// So every wait of the reducer (the step check, each bucket, the usage
// allreduce) is a wait with a deadline, `hang_timeout`: when it passes
// without completion, or the wait fails (a peer's connection closed), the
// waiting thread reports a StallEvent to a handler and then waits on, or
// raises the handler's message. A rank whose backward ends with buckets never
// launched reports kUnfinished at that moment (from a callback queued when its
// backward began), and kResolved if a second backward over the same forward
// completes them after all, or when a wait that stalled completes. When its
// next forward begins with them still unlaunched it reports kAbandoned and
// raises: no backward can complete them any more.
//
// Proof before the deadline. `hang_timeout` is for ranks that are merely
// late; a wait that a peer's report proves endless (that peer abandoned its
// buckets, or raised and left the collectives) should not last it. So the
// wait runs in slices of kProbeSlice (or `hang_timeout`, if shorter), and a
// slice that passes short of the deadline reports kWaiting: the handler
// reads one counter in the store, which every proof that a rank publishes
// increments, and reads the reports only when it moved (or every few
// seconds, for a backward that ended unfinished, which publishes no proof:
// see Note [Proven hangs] in ddp_ext/_diagnosis/hang.py). It returns a
// message to raise when they prove the wait endless, else nothing, and
// publishes nothing. A wait that completes within its first slice costs what
// it did before.
//
// The handler (the Python side, ddp_ext/_diagnosis/) publishes what this
// rank is doing through the store the process group was made from, a side
// channel that does not depend on the stuck collective, reads what the other
// ranks published, and decides whether to raise: the message naming the
// lagging rank, the step and the parameters is formatted there, never in the
// reducer, which describes only itself.
//
// Each wrapper meets its peers in the store under a key all ranks of its
// group agree on (ddp_ext/_diagnosis/hang.py, store_key): wrappers are
// numbered per group, and the construction's model check takes the largest
// number any rank proposes, so a wrapper that some ranks build and others do
// not cannot shift the keys under which the others read the reports (a
// wrapper built with init_sync=False, which runs no collective, takes its
// own rank's count).
//
// Reporting without the lock. The handler is Python that runs user code
// (warnings.warn: a filter, showwarning, a logging handler), which may call
// back into the wrapper (straggler_report(), _get_ddp_logging_data()) on the
// same thread. So each wait, and the handler, runs in a window without the
// reducer's lock (Note [Windows without the lock] in
// reducer/core/state_lock.cpp): readers go through, from any thread; a change
// from the handler's thread raises; changes from other threads wait until
// the window closes. A filter that turns the warning into an error makes
// the rank raise it, as on_hang="raise" does.
//
// Cost: a wait that completes within its first slice is one
// Work::wait(slice) instead of Work::wait(), the same condition variable;
// a hook's future not yet complete gets one callback. The per-gradient hook
// is untouched. The end-of-backward callback is queued once per backward.
// Off (timeout 0), every wait is the plain one.
struct StallEvent {
  enum Kind { kStalled, kFailed, kUnfinished, kResolved, kWaiting, kAbandoned };
  Kind kind = kStalled;
  // kStalled, kFailed, kWaiting: what the wait was for ("bucket",
  // "reduce-scatter", "step check", "usage"), and the bucket's index (-1
  // otherwise).
  std::string waiting_for;
  int64_t bucket = -1;
  double waited_s = 0.0;
  // kFailed: what the wait raised.
  std::string error;
};

const char* stall_kind_name(StallEvent::Kind kind);

// A StallEvent with what the reducer says about itself (only itself).
struct StallReport {
  StallEvent event;
  int rank = 0;
  // The training step whose backward is (or was last) under way, and the
  // synchronising forwards begun so far; see Note [Ranks out of step].
  int64_t step = 0;
  int64_t training_steps = 0;
  std::string phase;
  int64_t buckets_launched = 0;
  int64_t buckets_total = 0;
  // Parameters that got no gradient yet in this backward, and their buckets.
  std::vector<std::string> unready;
  std::vector<int64_t> unready_buckets;
};

// How often a wait asks whether a peer proved it endless; see the Note.
constexpr std::chrono::milliseconds kProbeSlice{1000};

class StallWatch {
 public:
  using Report = std::function<void(const StallEvent&)>;

  // timeout_ms <= 0 or no `report`: plain waits. `report` may throw; the
  // exception leaves the wait.
  void configure(int64_t timeout_ms, Report report);
  bool on() const {
    return timeout_.count() > 0 && static_cast<bool>(report_);
  }
  int64_t timeout_ms() const {
    return timeout_.count();
  }

  // Waits for `work` (or `future`); see the Note.
  void wait(c10d::Work& work, const char* waiting_for, int64_t bucket);
  void wait(c10::ivalue::Future& future, const char* waiting_for, int64_t bucket);

  // Reports an event that is not about a wait.
  void report(StallEvent::Kind kind);

  // Called with true before each wait and with false after it (also when it
  // raises): the reducer lets its lock go there. See Note [Windows without
  // the lock] in reducer/core/state_lock.cpp.
  using Window = std::function<void(bool open)>;
  void set_window(Window window) {
    window_ = std::move(window);
  }

 private:
  // A slice passed after `waited` (start to now), short of `deadline` or
  // not: reports kWaiting or kStalled, and moves `deadline` past a stall.
  void slice_passed(
      const char* waiting_for, int64_t bucket, std::chrono::steady_clock::time_point start,
      std::chrono::steady_clock::duration& deadline, bool& stalled);

  std::chrono::milliseconds timeout_{0};
  std::chrono::milliseconds slice_{0}; // min(timeout_, kProbeSlice)
  Report report_;
  Window window_;
};

} // namespace ddp_ext::reducer
