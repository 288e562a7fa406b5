#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>

namespace ddp_ext::compression {

// Launches collectives in the order their tickets were taken, whenever each
// becomes ready (see Note [Eight bits at any world size], Ordering): take()
// on the hook's thread, in hook order; ready() from any thread, in any
// order. A launch runs, under this object's lock, once every earlier
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

} // namespace ddp_ext::compression
