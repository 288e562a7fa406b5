#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace ddp_ext::reducer {

// The reducer's mutex and the windows in which the thread that changes the
// reducer lets it go; see Note [Windows without the lock] in
// reducer/core/state_lock.cpp. Guards every other member of the Reducer
// (hooks may run on several autograd threads).
struct StateLock {
  std::mutex mutex;
  // What each open window is for, innermost last (empty: none is open), the
  // one thread that opened them, and where changers from other threads wait.
  std::vector<const char*> windows;
  std::atomic<std::thread::id> window_thread{};
  std::condition_variable windows_closed;
};

} // namespace ddp_ext::reducer
