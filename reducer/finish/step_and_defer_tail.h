#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <utility>
#include <vector>

#include "reducer/finish/step_per_bucket.h"

namespace ddp_ext::reducer {

// Note [The next forward's buckets first]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Buckets are launched as the backward fills them: the last layers' first,
// the first layers' last. The next forward needs them the other way round,
// so when the link is the bottleneck the first layer the forward runs
// waits for every bucket. With a forward tail (set by
// ddp_ext/_forward_tail.py, with a bucket step: Note [Stepping reduced
// buckets]) the buckets holding about a given fraction of the gradient
// bytes, counted from the first layers (the last buckets; never bucket 0),
// are held when ready:
//  - launching: when the backward's last bucket is ready, the held ones
//    are launched from the last bucket down, the order in which the next
//    forward reads them. Which buckets are held follows from the layout
//    and the fraction alone, the same on every rank, so the ranks launch
//    the same collectives in the same order (what Gloo and NCCL pair by).
//    Each bucket is reduced exactly as before: only the order changes.
//  - the end of the backward waits for, writes back and steps the others
//    as before, and leaves the held ones on the wire (deferred_), each with
//    its Work and views, so a rebuild of the layout does not touch them.
//    Python waits for each (finish_deferred) when something first reads
//    one of its parameters or gradients, then steps it.
//  - nothing reuses a deferred bucket's memory before it is finished: the
//    next synchronising backward refuses to start while any is left (the
//    Python side finishes them all at the end of each forward).
// The reducer refuses a tail with layer dropping and with bucket views (.grad
// is the bucket, on the wire), and holds nothing in a backward with a
// communication hook (a hook may count buckets in order: PowerSGD's
// iteration ends at the last bucket), in a world of one, without overlap,
// and while a static graph is learned (EndOfBackward::arm's `may_hold`).

class StepAndDeferTail final : public StepPerBucket {
 public:
  // `fraction` of the gradient bytes, in [0, 1), is held.
  StepAndDeferTail(BucketStep step, double fraction);

  double fraction() const {
    return fraction_;
  }
  void arm(const std::vector<Bucket>& buckets, bool may_hold) override;
  size_t held_from(size_t bucket_count) const override {
    return std::min(held_from_, bucket_count);
  }
  std::exception_ptr finish(ReducedBuckets& buckets) override;

  std::vector<std::pair<size_t, std::vector<size_t>>> deferred() const override;
  size_t deferred_count() const override {
    return deferred_.size();
  }
  void finish_deferred(size_t bucket_index, DeferredFinisher& finisher) override;
  void forget_deferred() override {
    deferred_.clear();
  }

 private:
  const double fraction_;
  size_t held_from_ = 0; // of the backward armed last
  std::vector<DeferredBucket> deferred_;
  BackwardUsage usage_; // of the backward that left them
};

} // namespace ddp_ext::reducer
