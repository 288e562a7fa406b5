#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>

namespace ddp_ext {

// Launches collectives in the order their tickets were taken, whenever each
// becomes ready: for a step of a multi-step collective that can start only
// once the step before has arrived, so is issued from a completion callback
// (see Note [Eight bits at any world size], Ordering, and Note
// [Hierarchical allreduce]). take() on the caller's thread, in call order;
// ready() from any thread, in any order. A launch runs, under this object's lock, once every earlier
// ticket's launch has run, so every rank issues them in ticket order.
class OrderedLaunches {
 public:
  using Ticket = uint64_t;

  Ticket take();
  // `launch` for `ticket`; runs it now, on this thread, together with any
  // later ones it was holding up, or keeps it until the earlier ones are
  // ready. A launch must not call back into this object.
  void ready(Ticket ticket, std::function<void()> launch);

  // Tickets taken whose launch has not run yet.
  size_t pending() const;

 private:
  mutable std::mutex mutex_;
  Ticket next_ticket_ = 0;
  Ticket next_launch_ = 0;
  std::map<Ticket, std::function<void()>> waiting_;
};

} // namespace ddp_ext
