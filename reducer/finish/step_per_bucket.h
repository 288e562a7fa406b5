#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <utility>
#include <vector>

#include "reducer/finish/end_of_backward.h"

namespace ddp_ext::reducer {

// Note [Stepping reduced buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Without a bucket step, the end of a synchronising backward
// (finalize_backward) waits for every bucket, then writes every reduced
// gradient back to .grad, and the user's optimizer.step() runs after
// backward returns, with the link idle. With one (set by
// ddp_ext/_optimizer_overlap.py), finalize_backward takes the buckets one
// at a time, in launch order: it waits for bucket b, writes its gradients
// back, and calls the step with b's parameter indices, while buckets b+1...
// are still being reduced. The step runs where finalize_backward runs: in
// autograd's final callback, on the thread that called backward for a
// module on the CPU; never on a process group's thread.
//
// What each parameter ends with is what the plain order gives it:
//  - .grad: the same write-back, split by bucket. Which parameters no rank
//    used is known before any write-back: the usage allreduce (launched
//    after the last bucket) is awaited first. A stashed .grad of such a
//    parameter (a bucket view, see Note [Unused parameters]) is restored
//    into the bucket, which its allreduce would overwrite: with any stash,
//    every bucket is awaited before the first write-back (no overlap).
//  - the step: the caller steps exactly these parameters (their gradients
//    are final) and, at optimizer.step(), exactly the others.
//
// The step is user code (the optimizer): it runs in a window without the
// lock (Note [Windows without the lock]), so it may read the wrapper, and a
// change from it raises. If it raises, the later buckets are still awaited
// and written back but not stepped, the backward finishes (the reducer is
// idle again), and the error is raised from backward.
//
// The steps run inside the backward's wait for its buckets: the timeline's
// wait and the runtime statistics' end of communication include them.
//
// A static graph's first iteration (finish_learning_iteration) and a
// backward inside no_sync do not call the step; the user's optimizer.step()
// then steps every parameter, as without one.

class StepPerBucket : public EndOfBackward {
 public:
  explicit StepPerBucket(BucketStep step) : step_(std::move(step)) {}

  const BucketStep* step() const override {
    return &step_;
  }
  std::exception_ptr finish(ReducedBuckets& buckets) override;

 protected:
  // Waits for, writes back and steps buckets 0 .. end - 1 in turn; returns
  // what the step raised, if it did (the later buckets are still written
  // back, not stepped).
  std::exception_ptr step_through(ReducedBuckets& buckets, size_t end) const;

 private:
  const BucketStep step_;
};

} // namespace ddp_ext::reducer
