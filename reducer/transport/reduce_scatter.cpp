// Each bucket reduce-scattered into this rank's shard: Note [Sharded buckets].
#include "reducer/transport/reduce_scatter.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "process_groups/single_tensor_collectives.h"
#include "reducer/layout/bucket_memory.h"
#include "reducer/transport/allreduce.h"
#include "reducer/transport/ring_order_sum.h"

namespace ddp_ext::reducer {

namespace {

// Copies an allreduced bucket into its shard, which is the whole bucket
// (alone, or replicated).
void copy_whole(Bucket& bucket) {
  at::NoGradGuard no_grad;
  TORCH_INTERNAL_ASSERT(bucket.shard.numel() == bucket.flat.numel());
  bucket.shard.copy_(bucket.flat);
}

} // namespace

void ReduceScatter::complete(InFlight& entry, const TransportContext& context) {
  Bucket& bucket = *entry.bucket;
  if (bucket.work && entry.replicated) {
    replicated_->finish(entry.index, bucket, context); // unpacks a step check it carried
    copy_whole(bucket);
  } else if (bucket.work) {
    // At one rank (in place) an allreduce; else the bucket's reduce-scatter.
    await_work(*bucket.work, entry.index, context, entry.in_place ? "bucket" : "reduce-scatter");
    bucket.work.reset();
    if (entry.in_place) {
      copy_whole(bucket);
    } else if (entry.received.defined()) {
      ring_order_sum(
          entry.received, bucket.flat.numel(), context.group.getRank(), context.group.getSize(),
          bucket.shard);
    }
  }
  entry.sent = at::Tensor();
  entry.received = at::Tensor();
  release_bucket_memory(bucket);
}

void ReduceScatter::record(
    size_t index, const Bucket& bucket, int64_t bytes, const TransportContext& context,
    TimelineRange& range) {
  if (context.timeline.on()) {
    range.set_value(bytes);
    context.timeline.on_completion(*bucket.work, index);
  }
}

void ReduceScatter::launch(
    size_t index, size_t count, Bucket& bucket, const TransportContext& context,
    TimelineRange& range) {
  TORCH_CHECK(!bucket.sparse, "a sparse bucket cannot be reduce-scattered");
  if ((!in_flight_.empty() && index <= in_flight_.back().index) || index == 0) {
    in_flight_.clear(); // a new backward: the last one's entries are finished or dropped
    first_.reset();
  }
  while (in_flight_.size() >= kInFlight) {
    InFlight oldest = std::move(in_flight_.front());
    in_flight_.erase(in_flight_.begin());
    complete(oldest, context);
  }
  const int64_t ranks = context.group.getSize();
  const int64_t length = bucket.flat.numel();
  const bool replicated = replicates(bucket, ranks);
  const int64_t shard = replicated ? length : (length + ranks - 1) / ranks;
  if (!bucket.shard.defined() || bucket.shard.numel() != shard) {
    bucket.shard = at::empty({shard}, bucket.flat.options());
  }
  // The gradients are in the bucket now: autograd's own .grad goes.
  for (const at::Tensor& param : bucket.params) {
    param.mutable_grad().reset();
  }
  if (replicated) { // Note [Replicated small buckets]
    replicated_->launch(index, count, bucket, context, range); // bucket 0 may carry the step check
    InFlight entry{index, &bucket, at::Tensor(), at::Tensor(), /*in_place=*/true, /*replicated=*/true};
    if (index == 0) {
      first_ = std::move(entry); // finished with the step check, at the end of the backward
    } else {
      in_flight_.push_back(std::move(entry));
    }
    return;
  }
  const auto backend = context.group.getBackend(bucket.flat.device().type());
  if (backend->getBackendName() == "gloo") {
    if (ranks >= 3) {
      bucket.work = ring_.launch(backend, bucket.flat, bucket.shard, index);
      const RingPlan plan = RingPlan::of(length, bucket.flat.element_size(), ranks);
      record(
          index, bucket, plan.sent_elements(context.group.getRank()) * bucket.flat.element_size(),
          context, range);
      in_flight_.push_back(InFlight{index, &bucket, at::Tensor(), at::Tensor()});
      return;
    }
    if (ranks == 1) {
      std::vector<at::Tensor> tensors{bucket.flat};
      bucket.work = context.group.allreduce(tensors);
      record(index, bucket, bucket.flat.nbytes(), context, range);
      in_flight_.push_back(InFlight{index, &bucket, at::Tensor(), at::Tensor(), /*in_place=*/true});
      return;
    }
    // Range j to rank j, unpadded; the ring-ordered sum runs at the end.
    std::vector<int64_t> sent_splits(ranks);
    for (int64_t j = 0; j < ranks; ++j) {
      sent_splits[j] = std::clamp<int64_t>(length - j * shard, 0, shard);
    }
    const int64_t mine = sent_splits[context.group.getRank()];
    std::vector<int64_t> received_splits(ranks, mine);
    at::Tensor received = at::empty({ranks * mine}, bucket.flat.options());
    bucket.work = process_groups::all_to_all_single(
        context.group, received, bucket.flat, received_splits, sent_splits, c10d::AllToAllOptions());
    record(index, bucket, bucket.flat.nbytes(), context, range);
    in_flight_.push_back(InFlight{index, &bucket, at::Tensor(), std::move(received)});
    return;
  }
  at::Tensor sent = bucket.flat;
  if (shard * ranks != length) {
    at::NoGradGuard no_grad;
    sent = at::empty({shard * ranks}, bucket.flat.options());
    sent.narrow(0, 0, length).copy_(bucket.flat);
    sent.narrow(0, length, shard * ranks - length).zero_();
  }
  bucket.work = process_groups::reduce_scatter_single(
      context.group, bucket.shard, sent, c10d::ReduceScatterOptions());
  record(index, bucket, sent.nbytes(), context, range);
  in_flight_.push_back(
      InFlight{index, &bucket, shard * ranks != length ? sent : at::Tensor(), at::Tensor()});
}

void ReduceScatter::finish(size_t index, Bucket& bucket, const TransportContext& context) {
  if (first_ && first_->index == index && first_->bucket == &bucket) {
    InFlight entry = std::move(*first_);
    first_.reset();
    complete(entry, context);
    return;
  }
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    if (it->index == index && it->bucket == &bucket) {
      InFlight entry = std::move(*it);
      in_flight_.erase(it);
      complete(entry, context);
      return;
    }
  }
  InFlight alone{index, &bucket, at::Tensor(), at::Tensor()};
  complete(alone, context);
}

c10::intrusive_ptr<c10::ivalue::Future> ReduceScatter::reduce_for_joined(
    c10d::GradBucket& /*bucket*/, c10d::ProcessGroup& /*group*/) {
  TORCH_CHECK(false, "a sharded bucket cannot be shadowed by a joined rank");
}

} // namespace ddp_ext::reducer
