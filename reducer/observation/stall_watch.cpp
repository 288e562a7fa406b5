#include "reducer/observation/stall_watch.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

namespace ddp_ext::reducer {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Completion of a future, observable with a deadline.
struct Completion {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
};

// Keeps the owner's window open for one wait (StallWatch::set_window).
class OpenWindow {
 public:
  explicit OpenWindow(const StallWatch::Window& window) : window_(window) {
    if (window_) {
      window_(true);
    }
  }
  ~OpenWindow() {
    if (window_) {
      window_(false);
    }
  }
  OpenWindow(const OpenWindow&) = delete;
  OpenWindow& operator=(const OpenWindow&) = delete;

 private:
  const StallWatch::Window& window_;
};

} // namespace

const char* stall_kind_name(StallEvent::Kind kind) {
  switch (kind) {
    case StallEvent::kStalled:
      return "stalled";
    case StallEvent::kFailed:
      return "failed";
    case StallEvent::kUnfinished:
      return "unfinished";
    case StallEvent::kResolved:
      return "resolved";
    case StallEvent::kWaiting:
      return "waiting";
    case StallEvent::kAbandoned:
      return "abandoned";
  }
  return "unknown";
}

void StallWatch::configure(int64_t timeout_ms, Report report) {
  timeout_ = std::chrono::milliseconds(timeout_ms > 0 ? timeout_ms : 0);
  slice_ = std::min(timeout_, kProbeSlice);
  report_ = std::move(report);
}

void StallWatch::report(StallEvent::Kind kind) {
  if (on()) {
    StallEvent event;
    event.kind = kind;
    report_(event);
  }
}

void StallWatch::slice_passed(
    const char* waiting_for, int64_t bucket, Clock::time_point start,
    Clock::duration& deadline, bool& stalled) {
  const Clock::duration waited = Clock::now() - start;
  StallEvent event;
  event.waiting_for = waiting_for;
  event.bucket = bucket;
  event.waited_s = std::chrono::duration<double>(waited).count();
  if (waited >= deadline) {
    event.kind = StallEvent::kStalled; // the deadline passed: report, wait on
    stalled = true;
    while (deadline <= waited) {
      deadline += timeout_;
    }
  } else {
    event.kind = StallEvent::kWaiting; // short of it: look for a peer's proof
  }
  report_(event); // may raise
}

void StallWatch::wait(c10d::Work& work, const char* waiting_for, int64_t bucket) {
  const OpenWindow window(window_);
  if (!on()) {
    work.wait();
    return;
  }
  const auto start = Clock::now();
  Clock::duration deadline = timeout_;
  bool stalled = false;
  while (true) {
    try {
      work.wait(slice_);
      break;
    } catch (const std::exception&) {
      if (!work.isCompleted()) {
        slice_passed(waiting_for, bucket, start, deadline, stalled);
        continue;
      }
    }
    // Completed, though the timed wait raised (a deadline passing just as
    // the work completes raises too): the work's own outcome decides.
    try {
      work.wait();
      break;
    } catch (const std::exception& failure) {
      StallEvent event;
      event.kind = StallEvent::kFailed;
      event.waiting_for = waiting_for;
      event.bucket = bucket;
      event.waited_s = seconds_since(start);
      event.error = failure.what();
      report_(event); // may raise its own message instead
      throw;
    }
  }
  if (stalled) {
    report(StallEvent::kResolved); // what this rank published is over
  }
}

void StallWatch::wait(
    c10::ivalue::Future& future, const char* waiting_for, int64_t bucket) {
  const OpenWindow window(window_);
  if (on() && !future.completed()) {
    auto completion = std::make_shared<Completion>();
    future.addCallback([completion](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(completion->mutex);
      completion->done = true;
      completion->done_cv.notify_all();
    });
    const auto start = Clock::now();
    Clock::duration deadline = timeout_;
    bool stalled = false;
    std::unique_lock<std::mutex> lock(completion->mutex);
    while (!completion->done_cv.wait_for(
        lock, slice_, [&completion] { return completion->done; })) {
      lock.unlock();
      slice_passed(waiting_for, bucket, start, deadline, stalled);
      lock.lock();
    }
    lock.unlock();
    if (stalled && !future.hasError()) {
      report(StallEvent::kResolved); // what this rank published is over
    }
  }
  if (on() && future.hasError()) {
    StallEvent event;
    event.kind = StallEvent::kFailed;
    event.waiting_for = waiting_for;
    event.bucket = bucket;
    event.error = future.tryRetrieveErrorMessage();
    report_(event);
  }
  future.wait();
}

} // namespace ddp_ext::reducer
