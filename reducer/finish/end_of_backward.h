#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstddef>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include "reducer/layout/bucket.h"
#include "reducer/observation/timeline.h"
#include "reducer/participation/backward_usage.h"

namespace ddp_ext::reducer {

// Note [The end of a backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Once a synchronising backward's buckets are all launched, the reducer hands
// the rest of the backward to one strategy, an EndOfBackward, of the type the
// wrapper chose:
//  - WriteBackAll (torch's, the default): waits for every bucket, then writes
//    every reduced gradient back to .grad;
//  - StepPerBucket: waits for the buckets one at a time, writes each back and
//    steps its parameters (Note [Stepping reduced buckets]);
//  - StepAndDeferTail: steps per bucket, and holds the first layers' buckets:
//    launched last, first layer first, and left on the wire for the next
//    forward (Note [The next forward's buckets first]);
//  - KeepShards: with reduce-scattered buckets, writes nothing back and
//    hands each bucket's parameters to the caller (Note [Sharded buckets]).
// A strategy owns its state (the step, the share of bytes held, the buckets
// left on the wire) and reaches the backward's buckets only through
// ReducedBuckets, which the reducer hands it under its lock. Which
// parameters no rank used is one value per backward (Note [Used by no rank]).

// Called with the parameter indices of each bucket whose reduced gradients
// are in .grad.
using BucketStep = std::function<void(const std::vector<size_t>& param_indices)>;

// A bucket left on the wire, with what finishing it takes: kept apart from
// the layout, so that a rebuild does not touch it.
struct DeferredBucket {
  size_t index;
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> views;
  std::vector<size_t> param_indices;
};

// What a strategy may do with a backward's launched buckets (buckets
// 0 .. launched() - 1, in launch order).
class ReducedBuckets {
 public:
  virtual ~ReducedBuckets() = default;
  virtual size_t launched() const = 0;
  virtual Timeline& timeline() = 0;
  // Concluded on the first call (the usage bitmap's allreduce is awaited).
  virtual const BackwardUsage& usage() = 0;
  virtual void wait_for_all() = 0;
  virtual void wait_for(size_t bucket) = 0;
  virtual void write_back(size_t bucket) = 0;
  // Every bucket, and the stashed .grad of the parameters no rank used.
  virtual void write_back_all() = 0;
  // See Note [Unused parameters]: puts stashed .grad back into the reduced
  // buckets, after waiting for every bucket; false when none was stashed.
  virtual bool restore_stashed() = 0;
  virtual DeferredBucket leave_on_wire(size_t bucket) = 0;
  // Runs `step` for `bucket`'s parameters, without the reducer's lock.
  virtual void step(const BucketStep& step, size_t bucket) = 0;
  // The same with those of them some rank used (Note [Used by no rank]).
  virtual void step_used(const BucketStep& step, size_t bucket) = 0;
  // The observers' end of communication.
  virtual void collectives_done() = 0;
};

// Waits for a bucket left on the wire and writes its gradients back.
class DeferredFinisher {
 public:
  virtual ~DeferredFinisher() = default;
  virtual void finish(DeferredBucket& bucket, const BackwardUsage& usage) = 0;
};

class EndOfBackward {
 public:
  virtual ~EndOfBackward() = default;

  // The step per bucket; null: none.
  virtual const BucketStep* step() const {
    return nullptr;
  }
  // Whether it also ends a static graph's learning iteration (else the
  // reducer writes every gradient back).
  virtual bool ends_learning_iteration() const {
    return false;
  }
  // Called when a backward is armed: whether it may hold buckets (the
  // reducer's side of Note [The next forward's buckets first]).
  virtual void arm(const std::vector<Bucket>& buckets, bool may_hold) {}
  // The buckets from this index on are launched last, first layer first;
  // `bucket_count`: none.
  virtual size_t held_from(size_t bucket_count) const {
    return bucket_count;
  }
  // Ends the backward; returns what a step raised, if it did.
  virtual std::exception_ptr finish(ReducedBuckets& buckets) = 0;

  // The buckets the last backward left on the wire: each one's index and
  // parameter indices, in launch order.
  virtual std::vector<std::pair<size_t, std::vector<size_t>>> deferred() const {
    return {};
  }
  virtual size_t deferred_count() const {
    return 0;
  }
  // Finishes the deferred bucket `bucket_index`; a no-op for one not
  // deferred (any more).
  virtual void finish_deferred(size_t bucket_index, DeferredFinisher& finisher) {}
  // Drops the deferred buckets unfinished (their group is gone).
  virtual void forget_deferred() {}
};

// torch's end of a backward.
class WriteBackAll final : public EndOfBackward {
 public:
  std::exception_ptr finish(ReducedBuckets& buckets) override;
};

} // namespace ddp_ext::reducer
