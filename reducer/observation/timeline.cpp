#include "reducer/observation/timeline.h"

#include <algorithm>
#include <utility>

namespace ddp_ext::reducer {

// See Note [Communication timeline].

const char* timeline_range_name(int32_t kind) {
  switch (kind) {
    case TimelineEvent::kBucketLaunch:
      return "ddp_ext::launch_bucket";
    case TimelineEvent::kCommHook:
      return "ddp_ext::comm_hook";
    case TimelineEvent::kWaitForBuckets:
      return "ddp_ext::wait_for_buckets";
    case TimelineEvent::kFinalize:
      return "ddp_ext::finalize_backward";
    case TimelineEvent::kStepCheckWait:
      return "ddp_ext::wait_for_step_check";
    case TimelineEvent::kRebuild:
      return "ddp_ext::rebuild_buckets";
    default:
      return "ddp_ext::event";
  }
}

int64_t timeline_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Timeline::Timeline() : completions_(std::make_shared<Completions>()) {}

void Timeline::set_on(bool on) {
  on_ = on;
}

void Timeline::reserve(size_t events, size_t buckets) {
  record_when_awaited_.assign(buckets, 0);
  if (events_.capacity() - events_.size() < events) {
    events_.reserve(events_.size() + events);
  }
}

void Timeline::on_completion(
    const c10::intrusive_ptr<c10::ivalue::Future>& future, int64_t bucket) {
  {
    std::lock_guard<std::mutex> lock(completions_->mutex);
    ++completions_->outstanding;
  }
  future->addCallback(
      [completions = completions_, bucket](c10::ivalue::Future&) {
        const int64_t now = timeline_now_ns();
        {
          std::lock_guard<std::mutex> lock(completions->mutex);
          completions->events.push_back(TimelineEvent{
              TimelineEvent::kBucketDone, static_cast<int32_t>(bucket), now, now, 0});
          --completions->outstanding;
        }
        completions->done.notify_all();
      });
}

void Timeline::on_completion(c10d::Work& work, int64_t bucket) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work.getFuture();
  } catch (const c10::Error&) {
    // No future from this backend: see Note [Communication timeline].
  }
  if (future) {
    on_completion(future, bucket);
  } else if (static_cast<size_t>(bucket) < record_when_awaited_.size()) {
    record_when_awaited_[bucket] = 1;
  }
}

void Timeline::awaited(size_t bucket) {
  if (on_ && bucket < record_when_awaited_.size() && record_when_awaited_[bucket]) {
    record_when_awaited_[bucket] = 0;
    instant(TimelineEvent::kBucketDone, static_cast<int64_t>(bucket), /*value=*/1);
  }
}

std::vector<TimelineEvent> Timeline::take(int64_t* dropped, int64_t wait_ms) {
  std::vector<TimelineEvent> result = std::move(events_);
  events_ = std::vector<TimelineEvent>();
  {
    std::unique_lock<std::mutex> lock(completions_->mutex);
    completions_->done.wait_for(
        lock, std::chrono::milliseconds(wait_ms),
        [this] { return completions_->outstanding == 0; });
    result.insert(
        result.end(), completions_->events.begin(), completions_->events.end());
    completions_->events.clear();
  }
  std::stable_sort(
      result.begin(), result.end(),
      [](const TimelineEvent& a, const TimelineEvent& b) {
        return a.begin_ns < b.begin_ns;
      });
  *dropped = std::exchange(dropped_, 0);
  return result;
}

} // namespace ddp_ext::reducer
