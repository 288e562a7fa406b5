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

// Copies this rank's range of an allreduced bucket into its shard (zeros
// past the bucket's end).
void copy_range(Bucket& bucket, int64_t rank) {
  at::NoGradGuard no_grad;
  const int64_t length = bucket.flat.numel();
  const int64_t shard = bucket.shard.numel();
  const int64_t lo = std::min(rank * shard, length);
  const int64_t hi = std::min(lo + shard, length);
  bucket.shard.narrow(0, 0, hi - lo).copy_(bucket.flat.narrow(0, lo, hi - lo));
  if (hi - lo < shard) {
    bucket.shard.narrow(0, hi - lo, shard - (hi - lo)).zero_();
  }
}

} // namespace

void ReduceScatter::complete(InFlight& entry, const TransportContext& context) {
  Bucket& bucket = *entry.bucket;
  if (bucket.work) {
    await_work(*bucket.work, entry.index, context);
    bucket.work.reset();
    if (entry.in_place) {
      copy_range(bucket, context.group.getRank());
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
    size_t index, size_t /*count*/, Bucket& bucket, const TransportContext& context,
    TimelineRange& range) {
  TORCH_CHECK(!bucket.sparse, "a sparse bucket cannot be reduce-scattered");
  if (!in_flight_.empty() && index <= in_flight_.back().index) {
    in_flight_.clear(); // a new backward: the last one's entries are finished or dropped
  }
  while (in_flight_.size() >= kInFlight) {
    InFlight oldest = std::move(in_flight_.front());
    in_flight_.erase(in_flight_.begin());
    complete(oldest, context);
  }
  const int64_t ranks = context.group.getSize();
  const int64_t length = bucket.flat.numel();
  const int64_t shard = (length + ranks - 1) / ranks;
  if (!bucket.shard.defined() || bucket.shard.numel() != shard) {
    bucket.shard = at::empty({shard}, bucket.flat.options());
  }
  // The gradients are in the bucket now: autograd's own .grad goes.
  for (const at::Tensor& param : bucket.params) {
    param.mutable_grad().reset();
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
