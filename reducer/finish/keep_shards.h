#pragma once

#include <exception>
#include <utility>

#include "reducer/finish/end_of_backward.h"

namespace ddp_ext::reducer {

// The end of a backward whose buckets were reduce-scattered (Note [Sharded
// buckets] in reducer/transport/reduce_scatter.h): waits for every bucket
// (each one's memory is released as it finishes), writes nothing back to
// .grad (a full-size gradient exists nowhere any more), and calls the step
// with each bucket's parameters that some rank used (Note [Used by no
// rank]), in launch order, without the lock. The caller reads the shards;
// its optimizer step comes later, at optimizer.step(). Also ends a static
// graph's learning iteration, whose buckets are reduce-scattered alike.
class KeepShards final : public EndOfBackward {
 public:
  explicit KeepShards(BucketStep step) : step_(std::move(step)) {}

  const BucketStep* step() const override {
    return &step_;
  }
  bool ends_learning_iteration() const override {
    return true;
  }
  std::exception_ptr finish(ReducedBuckets& buckets) override;

 private:
  const BucketStep step_;
};

} // namespace ddp_ext::reducer
