// The reducer's lock and the windows in which it is let go.
#include <c10/util/Exception.h>

#include <string>

#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

// Note [Windows without the lock]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The reducer's state is guarded by one mutex, taken by every method: to
// read (the properties and getters the wrapper and frameworks call:
// has_rebuilt_buckets, bucket_indices, iterations, the logging data...) or
// to change (a gradient arriving, a forward, a setting). The rule:
//
//   No thread holds the mutex while it runs code the reducer does not own
//   (a communication hook, the hang handler: Python, which may call back
//   into the wrapper) or while it waits (for a collective, a hook's
//   future). It opens a window instead: it lets the mutex go for as long
//   as that lasts, and takes it back after (also when it raises).
//
// The hook of bucket b runs on the autograd thread that launches b, from
// inside on_gradient_ready, and torch's hooks read the wrapper there
// (hook_with_zero_step reads _has_rebuilt_buckets on every bucket); a
// future's callback (`fut.then`) runs on a thread of the process group
// while the autograd thread waits for that future at the end of the
// backward. With the mutex held through either, the read would wait for
// ever.
//
// While a window is open:
//  1. Nothing changes. A changer on another thread (another autograd
//     thread's gradient, a forward, a setting) waits in lock_state until
//     the last window closes, as it waited for the mutex before; so the
//     code around the window finds the state as it left it. In particular
//     buckets still launch in index order on every rank: launch_ready_buckets
//     launches bucket b (its hook runs in a window) before it advances
//     next_bucket_, and a later bucket's gradient on another thread waits
//     until the loop that launches in order has let the mutex go.
//  2. Readers go through, from any thread (the window's own, a process
//     group thread running a future's callback, another Python thread):
//     they take the mutex, which is free, or held for a moment by another
//     reader. They read what the changer left, and only read.
//  3. A change from the window's own thread (a hook that runs forward,
//     registers a hook, updates the process group) raises, naming the
//     window: it would pull the state from under the code that opened it.
//  4. Windows nest: the thread whose window is open may open another (a
//     hang report while it waits for a hook's future). Only the outermost
//     lets the mutex go and takes it back. Only the thread that changes
//     opens windows (every wait and hook run is part of a change), so one
//     thread at most has windows open.
//
// Why this cannot deadlock. The mutex is held only for short stretches: by
// a reader, or by a changer outside its windows, neither of which waits for
// a collective, a future or user code. Python reaches the reducer only
// through bindings that release the GIL before they take the mutex
// (bindings/: NoGil, without_gil, layout_reader), so no thread
// holds the GIL while it waits for the mutex, and a holder of the mutex
// that needs the GIL gets it. A process group thread that runs a
// callback reading the wrapper therefore gets the mutex and returns, and
// the collectives queued behind it complete. A changer waits only for
// windows to close, and a window closes when its hook returns, its
// collective or future completes, or its report is handled: none of those
// waits for a changer, unless user code makes it: a hook, or a callback the
// reducer waits for, that changes the wrapper from another thread waits for
// the window that waits for it. Hooks and their callbacks must only read
// (tests/hooks/test_hooks_reading_wrapper.py calls every reading method from both).
//
// Cost: opening and closing a window is an unlock and a lock, once per
// bucket for its hook and once per wait.

std::unique_lock<std::mutex> Reducer::lock_state(Access access) const {
  std::unique_lock<std::mutex> lock(lock_.mutex);
  if (access == Access::kRead || lock_.windows.empty()) {
    return lock;
  }
  if (lock_.window_thread.load() != std::this_thread::get_id()) {
    lock_.windows_closed.wait(lock, [this] { return lock_.windows.empty(); });
    return lock;
  }
  const std::string inside = lock_.windows.back();
  const int rank = process_group_->getRank();
  lock.unlock();
  TORCH_CHECK(
      false, "DistributedDataParallel on rank ", rank,
      " cannot be changed (forward, backward, no_sync, a hook or setting "
      "registered, the process group updated) from inside ", inside,
      ", which runs while the wrapper is in the middle of a change. Read "
      "from there (_has_rebuilt_buckets, bucket_indices(), "
      "_get_ddp_logging_data(), straggler_report()...), and change it after "
      "that returns.");
  return lock; // not reached
}

void Reducer::open_window(const char* what) {
  if (lock_.window_thread.load() == std::this_thread::get_id()) {
    // Nested: this thread let the mutex go already.
    std::lock_guard<std::mutex> lock(lock_.mutex);
    lock_.windows.push_back(what);
    return;
  }
  // The caller changes the reducer: it holds the mutex, and no window is open.
  TORCH_INTERNAL_ASSERT(lock_.windows.empty(), "a reducer window opened by two threads");
  lock_.windows.push_back(what);
  lock_.window_thread = std::this_thread::get_id();
  lock_.mutex.unlock();
}

void Reducer::close_window() {
  lock_.mutex.lock();
  lock_.windows.pop_back();
  if (!lock_.windows.empty()) {
    lock_.mutex.unlock(); // an outer window stays open
    return;
  }
  lock_.window_thread = std::thread::id();
  lock_.windows_closed.notify_all();
  // The mutex stays held: the caller's lock owns it again.
}

} // namespace ddp_ext::reducer
