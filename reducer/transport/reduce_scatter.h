#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "reducer/transport/bucket_transport.h"
#include "reducer/transport/ring_reduce_scatter.h"

namespace ddp_ext::reducer {

// Note [Sharded buckets]
// ~~~~~~~~~~~~~~~~~~~~~~
// With the optimizer sharded (ddp_ext/_sharded_optimizer.py) each bucket is
// reduce-scattered: the gradients are divided by the world size as they
// are copied in, as for the allreduce (Note [Gradient averaging]), and each
// rank receives the sum of its range of the bucket, Bucket::shard (the
// ranges of Note [Shard plan] in ddp_ext/_shard_plan.py: S = ceil(L / N)
// elements each, the bucket padded with zeros to N * S when L is not a
// multiple of N). Over Gloo, whose own reduce-scatter is an allreduce of a
// copy of the bucket followed by a copy of the rank's range (allreduce
// bytes), the shard is summed in the order Gloo's ring allreduce would have
// summed it (Note [Ring-ordered sum] in reducer/transport/ring_order_sum.h),
// with reduce-scatter bytes, so it holds exactly what the default allreduce
// leaves in that range, at any world size:
//  - at three ranks or more, by a ring of point-to-point sends that
//    accumulates in the bucket (Note [A ring of sends for the
//    reduce-scatter] in reducer/transport/ring_reduce_scatter.h): each rank
//    sends only to its neighbour, and the ring in flight takes one chunk
//    (1/N of the bucket) more;
//  - at two ranks, where the ring and an all-to-all send the same bytes,
//    by an all-to-all of the ranges, unpadded, into a buffer of the 2
//    copies of this rank's range, summed into the shard when it finishes:
//    one more bucket-sized tensor per bucket in flight, released with the
//    bucket.
// Alone (one rank) the bucket is allreduced in place and its range copied.
// Elsewhere (NCCL) the group's own reduce-scatter runs. What the gradients
// take on a rank is then:
//  - each bucket's memory only while it is filled and on the wire: the
//    buckets are separate (Note [Released bucket memory] in
//    reducer/layout/bucket_memory.h), grown when their first gradient is
//    copied in, released once their reduce-scatter finished;
//  - a parameter's .grad that autograd produced: dropped once copied into
//    its bucket (at the launch), also with gradient_as_bucket_view, which
//    the buckets then do not alias;
//  - the shards: 1/N of the buckets, kept.
// At most kInFlight buckets are on the wire: launching one waits first for
// the oldest (through the StallWatch, without the lock), so the buckets a
// backward holds at once are those being filled and those in flight, not
// all of them. The end of the backward (KeepShards, Note [The end of a
// backward]) writes nothing back: it hands each bucket's used parameters
// to the caller, which reads the shard.
// A bucket of fewer bytes than replicated_below (ranks > 1) is not cut:
// Note [Replicated small buckets].
// ReduceScatter answers runs_hook() as a hook does: every rank, alone
// too, must reduce-scatter (the shard exists nowhere else), no bucket is
// left on the wire for the next forward, and the step check does not ride
// on a sharded bucket 0 (it rides on a replicated one: Note [Replicated
// small buckets]).
// Note [Replicated small buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Sharding a small bucket saves little of the step and costs a second
// collective (its all-gather) and its latency. So a bucket whose flat
// gradient holds fewer than `replicated_below` bytes, at two ranks or
// more, is allreduced in place as the default transport allreduces it (the
// same bits on every rank as torch's DDP's) and its shard is the whole
// bucket: every rank steps it whole, keeps its optimizer state whole, and
// no all-gather follows (ddp_ext/_sharded_optimizer.py decides by the same
// rule, replicates() in ddp_ext/_shard_plan.py). 0 cuts every
// bucket. Alone (one rank) the shard is the whole bucket either way.
// A replicated bucket travels by the transport the reducer would use
// without sharding (its step check policy's, CarrierWithStepCheck over
// Gloo), so a replicated bucket 0 carries the backward's step check as it
// does there (Note [The step check on a replicated bucket 0] in
// reducer/agreement/step_check.h); it is finished with the check, at the
// end of the backward, and is not counted among the kInFlight.
class ReduceScatter : public BucketTransport {
 public:
  static constexpr size_t kInFlight = 2;

  // `replicated`: the transport of the buckets below `replicated_below`.
  ReduceScatter(int64_t replicated_below, std::shared_ptr<BucketTransport> replicated)
      : replicated_below_(replicated_below), replicated_(std::move(replicated)) {}

  // Whether `bucket` is replicated over `ranks` ranks (Note [Replicated small buckets]).
  bool replicates(const Bucket& bucket, int64_t ranks) const {
    return ranks > 1 && static_cast<int64_t>(bucket.flat.nbytes()) < replicated_below_;
  }
  // The replicated buckets carry the new step check.
  void step_check_replaced(std::shared_ptr<BucketTransport> unhooked) override {
    replicated_ = std::move(unhooked);
  }

  void launch(
      size_t index, size_t count, Bucket& bucket, const TransportContext& context,
      TimelineRange& range) override;
  void finish(size_t index, Bucket& bucket, const TransportContext& context) override;

  bool averages_while_copying() const override {
    return true;
  }
  bool runs_hook() const override {
    return true; // see the Note
  }
  bool keeps_per_bucket_state() const override {
    return false;
  }
  bool carries_step_check(const Bucket& first, int64_t ranks) const override {
    return replicates(first, ranks) && replicated_->carries_step_check(first, ranks);
  }

  // Join is refused with sharding (a joined rank would shadow an allreduce).
  c10::intrusive_ptr<c10::ivalue::Future> reduce_for_joined(
      c10d::GradBucket& bucket, c10d::ProcessGroup& group) override;

 private:
  struct InFlight {
    size_t index;
    Bucket* bucket; // valid within the backward that launched it
    at::Tensor sent; // the padded copy, when the bucket needed one
    at::Tensor received; // Gloo: the N copies of this rank's range, summed at the end
    bool in_place = false; // allreduced in place (alone, or replicated): copied whole into the shard
    bool replicated = false; // by replicated_: finished through it
  };
  // Waits for `entry`'s reduce-scatter and releases its bucket's memory.
  void complete(InFlight& entry, const TransportContext& context);
  // Tells the timeline what bucket `index` sent: `bytes`.
  static void record(
      size_t index, const Bucket& bucket, int64_t bytes, const TransportContext& context,
      TimelineRange& range);

  int64_t replicated_below_; // bytes: Note [Replicated small buckets]
  std::shared_ptr<BucketTransport> replicated_;
  std::vector<InFlight> in_flight_; // in launch order
  std::optional<InFlight> first_; // a replicated bucket 0: finished with the step check
  RingReduceScatter ring_; // Gloo at three ranks or more; destroyed first
};

} // namespace ddp_ext::reducer
