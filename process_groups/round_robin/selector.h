#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>

namespace ddp_ext::process_groups {

// Hands out child indices 0, 1, ..., count-1, 0, 1, ... one per call.
//
// Pure bookkeeping with no torch dependency: RoundRobinBackend asks it which
// child gets the next collective. Every rank owns its own selector, and they
// agree because every rank makes the same sequence of collective calls (see
// Note [Round-robin process group] in process_groups/round_robin/backend.h).
//
// next() is safe to call from several threads at once; each call gets its own
// turn. (Which thread gets which turn is then up to the scheduler, so callers
// that need cross-rank agreement issue their collectives from one thread or in
// a fixed order, as they must for any c10d process group.)
class RoundRobinSelector {
 public:
  explicit RoundRobinSelector(std::size_t count) : count_(count) {
    if (count == 0) {
      throw std::invalid_argument(
          "RoundRobinSelector needs at least one child to choose from, got 0");
    }
  }

  RoundRobinSelector(const RoundRobinSelector&) = delete;
  RoundRobinSelector& operator=(const RoundRobinSelector&) = delete;

  // The index whose turn it is, and moves the turn on to the next index.
  std::size_t next() {
    return static_cast<std::size_t>(
        taken_.fetch_add(1, std::memory_order_relaxed) % count_);
  }

  // The index next() will return, without taking the turn.
  std::size_t peek() const {
    return static_cast<std::size_t>(taken() % count_);
  }

  // How many turns next() has handed out. (64 bits: at a billion calls a
  // second it would take centuries to wrap and skew the rotation.)
  std::uint64_t taken() const {
    return taken_.load(std::memory_order_relaxed);
  }

  std::size_t count() const {
    return count_;
  }

 private:
  const std::size_t count_;
  std::atomic<std::uint64_t> taken_{0};
};

} // namespace ddp_ext::process_groups
