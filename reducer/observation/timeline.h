#pragma once

#include <ATen/record_function.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "reducer/observation/observer.h"

namespace ddp_ext::reducer {

// Note [Communication timeline]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The reducer can record when each phase of an iteration happened, for a
// Chrome trace per rank (ddp_ext/_timeline.py formats and writes it; see the
// README's "Communication timeline"). The recorder stores raw events only:
// a kind, a bucket or parameter index, two timestamps and a number. Names,
// JSON and files are the Python side's business, after the iteration.
//
// Off (the default), every recording call is one branch on a bool the
// reducer's mutex guards: no clock read, no allocation, no lock of its own.
// On, the per-gradient hook reads the clock and stores 32 bytes into a
// buffer reserved before the backward began (prepare_for_backward reserves
// room for a whole iteration); a buffer that still fills up drops events and
// counts them rather than allocate in a hook.
//
// Timestamps are CLOCK_MONOTONIC nanoseconds (std::chrono::steady_clock),
// the clock of Python's time.monotonic_ns, so the wrapper's forward events
// line up with the reducer's.
//
// Bucket completion is recorded by a callback on the bucket's future (the
// Work's future for the default allreduce, the hook's future otherwise): the
// moment the collective finished, on whichever thread finished it (Gloo's
// worker threads on CPU), not the moment the end of the backward waited for
// it, which would show every bucket finishing together. Those callbacks
// append to a second buffer under a mutex of their own. A future's callbacks
// run just after its waiters wake, so take() first waits (briefly) for the
// callbacks of launched buckets still outstanding. A backend whose Work has
// no future gets its completion recorded when the end of the backward
// awaited it (flagged in the event).
//
// Every range is also an at::RecordFunction (user scope) while the timeline
// is on, so torch.profiler traces show ddp_ext's phases too.
//
// Bucket indices are those of the layout the bucket was launched in; a
// rebuild (recorded as a range: the first at the start of the forward that
// does it, later ones at the end of the backward that agreed on them)
// renumbers the buckets from the next backward on.
//
// Why the Chrome trace is written in Python rather than here, as the design
// sketch had it: the parameter names and the wrapper's forward live on the
// Python side, the file is written once per recording, far from any hook,
// and the C++ side then stays a fixed-size store with no formatting, file
// or JSON code to keep off the hot path.
struct TimelineEvent {
  enum Kind : int32_t {
    kBackwardBegin = 0, // instant: the first gradient of a synchronising backward
    kGradientReady = 1, // instant: index = parameter
    kBucketLaunch = 2, // range: launching bucket `index`; value = bytes
    kBucketDone = 3, // instant: bucket `index` reduced; value = 1 if seen by waiting
    kCommHook = 4, // range: the communication hook's runHook for bucket `index`
    kWaitForBuckets = 5, // range: the end of backward waiting for launched buckets
    kFinalize = 6, // range: the end of backward as a whole (ends the backward)
    kStepCheckLaunch = 7, // instant: the step check's allreduce started
    kStepCheckWait = 8, // range: waiting for the step check
    kRebuild = 9, // range: rebuilding buckets; value = buckets after
  };
  int32_t kind;
  int32_t index;
  int64_t begin_ns;
  int64_t end_ns; // == begin_ns for instants
  int64_t value;
};

// Names of the RecordFunction ranges, per kind (nullptr: none).
const char* timeline_range_name(int32_t kind);

int64_t timeline_now_ns();

// An observer of the reducer (Note [Reducer observers]) that also records
// the ranges and completions the reducer hands it.
class Timeline : public ReducerObserver {
 public:
  Timeline();

  bool on() const {
    return on_;
  }

  // Starts or stops recording; recorded events stay until taken.
  void set_on(bool on);

  // Makes room for `events` more events without allocating while recording,
  // in an iteration with `buckets` buckets.
  void reserve(size_t events, size_t buckets);
  // Makes room for a whole iteration over `buckets` buckets of `params`
  // parameters: at most one gradient instant per parameter, a launch, hook
  // and completion per bucket, and a few more.
  void reserve_iteration(size_t params, size_t buckets) {
    reserve(params + 4 * buckets + 16, buckets);
  }

  // See Note [Reducer observers].
  void on_iteration_ahead(size_t params, size_t buckets) override {
    if (on_) {
      reserve_iteration(params, buckets);
    }
  }
  void on_backward_begin() override {
    instant(TimelineEvent::kBackwardBegin, -1);
  }
  void on_step_check_launched() override {
    instant(TimelineEvent::kStepCheckLaunch, -1);
  }

  void instant(int32_t kind, int64_t index, int64_t value = 0) {
    if (on_) {
      const int64_t now = timeline_now_ns();
      push(TimelineEvent{kind, static_cast<int32_t>(index), now, now, value});
    }
  }

  void range(int32_t kind, int64_t index, int64_t begin_ns, int64_t value = 0) {
    push(TimelineEvent{kind, static_cast<int32_t>(index), begin_ns,
                       timeline_now_ns(), value});
  }

  // Records bucket `bucket`'s completion when `future` completes.
  void on_completion(
      const c10::intrusive_ptr<c10::ivalue::Future>& future, int64_t bucket);

  // The same for a Work: through its future, or, for a backend whose Work has
  // none, when awaited() is called for the bucket.
  void on_completion(c10d::Work& work, int64_t bucket);
  void awaited(size_t bucket);

  // Every event recorded so far (completions included, after waiting at most
  // `wait_ms` for outstanding ones), and the count of events dropped
  // because the buffer was full; empties the buffers.
  std::vector<TimelineEvent> take(int64_t* dropped, int64_t wait_ms);

 private:
  void push(const TimelineEvent& event) {
    if (events_.size() < events_.capacity()) {
      events_.push_back(event);
    } else {
      ++dropped_;
    }
  }

  // Shared with completion callbacks, which may outlive the reducer.
  struct Completions {
    std::mutex mutex;
    std::condition_variable done;
    std::vector<TimelineEvent> events;
    int64_t outstanding = 0;
  };

  bool on_ = false; // guarded by the reducer's mutex, like events_
  std::vector<TimelineEvent> events_;
  int64_t dropped_ = 0;
  std::shared_ptr<Completions> completions_;
  std::vector<char> record_when_awaited_; // per bucket, this iteration
};

// A range of the timeline and of torch.profiler, from construction to
// destruction; nothing at all while the timeline is off.
class TimelineRange {
 public:
  TimelineRange(Timeline& timeline, int32_t kind, int64_t index = -1)
      : timeline_(timeline), kind_(kind), index_(index) {
    if (timeline_.on()) {
      begin_ns_ = timeline_now_ns();
      profiler_range_.emplace(at::RecordScope::USER_SCOPE);
      if (profiler_range_->isActive()) {
        profiler_range_->before(timeline_range_name(kind));
      }
    }
  }

  ~TimelineRange() {
    if (begin_ns_ >= 0) {
      profiler_range_.reset();
      timeline_.range(kind_, index_, begin_ns_, value_);
    }
  }

  TimelineRange(const TimelineRange&) = delete;
  TimelineRange& operator=(const TimelineRange&) = delete;

  void set_value(int64_t value) {
    value_ = value;
  }

 private:
  Timeline& timeline_;
  int32_t kind_;
  int64_t index_;
  int64_t begin_ns_ = -1;
  int64_t value_ = 0;
  std::optional<at::RecordFunction> profiler_range_;
};

} // namespace ddp_ext::reducer
