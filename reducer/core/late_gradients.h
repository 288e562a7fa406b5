#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reducer/observation/observer.h"

namespace ddp_ext::reducer {

// Note [Late gradients]
// ~~~~~~~~~~~~~~~~~~~~~
// A second backward over a forward whose gradients were already reduced
// (loss.backward(retain_graph=True) then loss.backward(); two losses of one
// forward, each backwarded alone) reaches an idle reducer. As torch's DDP
// does, its gradients stay in .grad on this rank alone, unaveraged (Note
// [Unprepared backward]), and the ranks drift apart. torch's DDP says
// nothing; ddp_ext records the parameters concerned here, and the wrapper
// warns once per rank at its next forward (LocalGradientWarning,
// ddp_ext/_late_gradients.py), with no collective and outside the lock.
//
// Recorded: a gradient that arrives while the reducer is idle, after the
// synchronised backward of the last forward and before the next forward,
// from a backward whose graph runs through that forward. The last test tells
// a second backward over the same forward from a backward through the wrapped
// module called directly, which torch's own tests run on purpose (to
// accumulate without no_sync) and which must stay silent: autograd numbers
// the nodes each thread creates in order, so the synchronised forward's
// nodes are those its thread created between prepare_for_forward and
// prepare_for_backward, and the engine's current graph task lists the nodes
// of the running backward (its root aside). The search runs once per
// backward, and only for a gradient that is already late.
//
// Not recorded: a backward inside no_sync (the reducer accumulates, it is
// not idle), a backward before any synchronisation, one that completes an
// unfinished reduction (the reducer is still reducing), and one inside the
// forward (prepare_for_forward ended the window).

// Which parameters got a gradient from a late backward. An observer (Note
// [Reducer observers]) of the turning points that delimit the synchronised
// forward and open the window. Not thread-safe: the reducer calls it under
// its lock. record() does not allocate.
class LateGradients : public ReducerObserver {
 public:
  explicit LateGradients(size_t params);

  // A forward starts on this thread: the window closes, and the nodes this
  // thread creates from now on may be the next synchronised forward's.
  void on_forward() override;
  // That forward's backward will synchronise: its nodes end here.
  void on_backward_armed() override;
  // The synchronised backward has all its gradients: once the reducer is
  // idle again, a gradient is late.
  void on_gradients_done() override;

  // Parameter `index` got a gradient while the reducer was idle.
  void record(size_t index);
  bool any() const {
    return count_ > 0;
  }
  // The indices recorded, in order, forgotten.
  std::vector<size_t> take();

 private:
  // Whether the running backward's graph holds a node of the synchronised
  // forward; decided once per graph task.
  bool through_synchronised_forward();

  std::vector<bool> recorded_;
  size_t count_ = 0;
  bool open_ = false;
  // The synchronised forward's nodes: created on forward_thread_, with
  // sequence numbers in [first_node_, end_node_).
  uint64_t forward_thread_ = 0;
  uint64_t first_node_ = 0;
  uint64_t end_node_ = 0;
  int64_t judged_task_ = -1; // the graph task judged last (-1: none)
  bool judged_late_ = false;
};

} // namespace ddp_ext::reducer
