#pragma once

#include <ATen/core/grad_mode.h>

#include <optional>
#include <utility>
#include <vector>

#include "reducer/core/reducer.h"
#include "reducer/transport/allreduce.h"

namespace ddp_ext::reducer {

// The reducer's side of Note [The end of a backward]: what a strategy may do
// with the buckets of the backward under way (or, for a bucket left on the
// wire, of the one that left it). Lives on the stack of a reducer method
// that holds the lock.
class Reducer::BucketsOfBackward final : public ReducedBuckets, public DeferredFinisher {
 public:
  explicit BucketsOfBackward(Reducer& reducer) : reducer_(reducer) {}

  size_t launched() const override {
    return reducer_.next_bucket_;
  }
  Timeline& timeline() override {
    return reducer_.timeline_;
  }
  const BackwardUsage& usage() override {
    if (!usage_) {
      usage_ = reducer_.conclude_usage();
    }
    return *usage_;
  }
  void wait_for_all() override {
    reducer_.wait_for_launched_buckets();
  }
  void wait_for(size_t bucket) override {
    reducer_.wait_for_bucket(bucket);
  }
  void write_back(size_t bucket) override {
    reducer_.write_back_bucket(reducer_.layout_.buckets()[bucket], usage());
  }
  void write_back_all() override {
    reducer_.write_back_gradients(usage());
  }
  bool restore_stashed() override {
    if (!reducer_.gradients_stay_local_ && reducer_.usage_.stashed_any()) {
      reducer_.wait_for_launched_buckets(); // the stashes go back into reduced buckets
      at::NoGradGuard no_grad;
      const BackwardUsage& used = usage();
      reducer_.usage_.restore_stashed(
          reducer_.params_, [&](size_t index) { return used.used_by_no_rank(index); });
    }
    return reducer_.usage_.stashed_any();
  }
  DeferredBucket leave_on_wire(size_t bucket) override {
    Bucket& left = reducer_.layout_.buckets()[bucket];
    DeferredBucket deferred{bucket, std::move(left.work), left.views, left.param_indices};
    left.work.reset();
    return deferred;
  }
  void step(const BucketStep& step, size_t bucket) override {
    const std::vector<size_t> indices = reducer_.layout_.buckets()[bucket].param_indices;
    UnlockedWindow window(reducer_, "the optimizer step of a reduced bucket");
    step(indices);
  }
  void step_used(const BucketStep& step, size_t bucket) override {
    std::vector<size_t> used;
    for (size_t index : reducer_.layout_.buckets()[bucket].param_indices) {
      if (!usage().used_by_no_rank(index)) {
        used.push_back(index);
      }
    }
    UnlockedWindow window(reducer_, "the record of a reduce-scattered bucket");
    step(used);
  }
  void collectives_done() override {
    reducer_.observers_.notify(&ReducerObserver::on_collectives_done);
  }

  void finish(DeferredBucket& bucket, const BackwardUsage& usage) override {
    if (bucket.work) {
      await_work(*bucket.work, bucket.index, reducer_.transport_context());
    }
    reducer_.write_back_views(bucket.views, bucket.param_indices, usage, /*as_view=*/false);
  }

 private:
  Reducer& reducer_;
  std::optional<BackwardUsage> usage_; // concluded on first use
};

} // namespace ddp_ext::reducer
