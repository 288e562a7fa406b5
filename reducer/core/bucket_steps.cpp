// Stepping each bucket's parameters as soon as the bucket is reduced.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "reducer/core/reducer.h"

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

void Reducer::set_bucket_step(BucketStep step) {
  BucketStep previous; // released after the lock: it may hold Python objects
  const auto lock = lock_state(Access::kChange);
  TORCH_CHECK(
      phase_ != Phase::kReducing,
      "DistributedDataParallel on rank ", process_group_->getRank(),
      " cannot change its bucket step while gradients are being reduced; "
      "change it between iterations");
  previous = std::exchange(bucket_step_, std::move(step));
}

std::exception_ptr Reducer::step_buckets_as_reduced() {
  TimelineRange wait_range(timeline_, TimelineEvent::kWaitForBuckets);
  const BackwardUsage usage = conclude_usage();
  if (!gradients_stay_local_ && usage_.stashed_any()) {
    wait_for_launched_buckets(); // the stashes go back into reduced buckets
    at::NoGradGuard no_grad;
    usage_.restore_stashed(params_, [&](size_t index) { return usage.used_by_no_rank(index); });
  }
  // See Note [The next forward's buckets first]: the held buckets stay on
  // the wire (the stashes above waited for them already: then none does).
  const size_t deferred_from = usage_.stashed_any() ? next_bucket_ : std::min(held_from_, next_bucket_);
  for (size_t b = next_bucket_; b-- > deferred_from;) {
    Bucket& bucket = layout_.buckets()[b];
    deferred_.push_back({b, std::move(bucket.work), bucket.views, bucket.param_indices});
    bucket.work.reset();
  }
  if (!deferred_.empty()) {
    deferred_usage_ = usage;
  }
  const BucketStep step = bucket_step_; // a copy: see Note [Windows without the lock]
  std::exception_ptr failed;
  for (size_t b = 0; b < deferred_from; ++b) {
    wait_for_bucket(b); // a no-op for a bucket awaited already
    Bucket& bucket = layout_.buckets()[b];
    write_back_bucket(bucket, usage);
    if (failed) {
      continue;
    }
    const std::vector<size_t> indices = bucket.param_indices;
    try {
      WithoutLock window(*this, "the optimizer step of a reduced bucket");
      step(indices);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  observers_.notify(&ReducerObserver::on_collectives_done);
  return failed;
}

} // namespace ddp_ext::reducer
