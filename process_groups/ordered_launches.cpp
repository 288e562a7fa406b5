#include "process_groups/ordered_launches.h"

#include <c10/util/Exception.h>

#include <utility>

namespace ddp_ext {

OrderedLaunches::Ticket OrderedLaunches::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_ticket_++;
}

void OrderedLaunches::ready(Ticket ticket, std::function<void()> launch) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(ticket >= next_launch_ && ticket < next_ticket_ && !waiting_.count(ticket),
              "OrderedLaunches: ticket ", ticket, " is not waiting (next to launch ",
              next_launch_, ", next to take ", next_ticket_, ")");
  waiting_.emplace(ticket, std::move(launch));
  // Run every launch whose predecessors have all run. Each leaves the map
  // before it runs, so one that throws does not hold back those after it.
  while (!waiting_.empty() && waiting_.begin()->first == next_launch_) {
    std::function<void()> next = std::move(waiting_.begin()->second);
    waiting_.erase(waiting_.begin());
    ++next_launch_;
    next();
  }
}

size_t OrderedLaunches::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<size_t>(next_ticket_ - next_launch_);
}

} // namespace ddp_ext
