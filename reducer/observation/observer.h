#pragma once

#include <cstddef>
#include <vector>

namespace ddp_ext::reducer {

// Note [Reducer observers]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// What watches the reducer (the step timings of Note [Runtime statistics]
// and Note [Stragglers], the communication timeline, the late gradients of
// Note [Late gradients] in reducer/core/late_gradients.h) learns of the
// iteration's turning points through one interface, ReducerObserver: the
// reducer notifies its observers and does not know what each one does with
// the news. A notification is a virtual call per observer, made per
// iteration or per bucket, never per gradient: the per-gradient hook records
// its timeline instant directly (one branch while the timeline is off, Note
// [Communication timeline]). The timeline's ranges (a bucket's launch, a
// hook, a wait) and the completions of launched buckets stay calls on the
// timeline, which records them; the hang watch is not an observer either: it
// waits (Note [Hang attribution]).
//
// Every notification is made under the reducer's lock, by the thread that
// changes the reducer: an observer must not wait, nor call back into it.
class ReducerObserver {
 public:
  virtual ~ReducerObserver() = default;

  // A forward with gradients enabled begins (prepare_for_forward).
  virtual void on_forward() {}
  // A backward is armed (prepare_for_backward), before anything left of an
  // unfinished iteration is awaited.
  virtual void on_backward_armed() {}
  // An iteration's events are ahead, over `buckets` buckets of `params`
  // parameters: a backward was armed, or a forward is about to rebuild the
  // buckets.
  virtual void on_iteration_ahead(size_t params, size_t buckets) {}
  // The backward's first gradient arrived: the reducer starts reducing.
  virtual void on_backward_begin() {}
  // The step check's collective was launched (Note [Ranks out of step]).
  virtual void on_step_check_launched() {}
  // Bucket `bucket` is about to be launched.
  virtual void on_bucket_launch(size_t bucket) {}
  // Every gradient of the backward has arrived: the end of the backward.
  virtual void on_gradients_done() {}
  // Every bucket launched was awaited.
  virtual void on_collectives_done() {}
};

// The reducer's observers, added at its construction; notify() calls one
// method of each, in the order they were added.
class ReducerObservers {
 public:
  void add(ReducerObserver* observer) {
    observers_.push_back(observer);
  }

  template <typename... Args, typename... Given>
  void notify(void (ReducerObserver::*event)(Args...), Given... given) {
    for (ReducerObserver* observer : observers_) {
      (observer->*event)(given...);
    }
  }

 private:
  std::vector<ReducerObserver*> observers_;
};

} // namespace ddp_ext::reducer
