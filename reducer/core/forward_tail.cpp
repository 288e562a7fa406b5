// The next forward overlapped with the tail of the backward's communication.
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "reducer/core/reducer.h"

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
// Holding is off with a communication hook (a hook may count buckets in
// order: PowerSGD's iteration ends at the last bucket), layer dropping,
// bucket views (.grad is the bucket, on the wire), a world of one, and
// while a static graph is learned; the Python side refuses the first three.

void Reducer::set_forward_tail(double fraction) {
  const auto lock = lock_state(Access::kChange);
  TORCH_CHECK(
      fraction >= 0 && fraction < 1,
      "the forward tail is a fraction of the gradient bytes in [0, 1), not ", fraction);
  TORCH_CHECK(
      phase_ != Phase::kReducing,
      "DistributedDataParallel on rank ", process_group_->getRank(),
      " cannot change its forward tail while gradients are being reduced; "
      "change it between iterations");
  forward_tail_ = fraction;
}

size_t Reducer::first_held_bucket() const {
  const auto& buckets = layout_.buckets();
  const size_t none = buckets.size();
  if (forward_tail_ <= 0 || !bucket_step_ || comm_hook_ != nullptr ||
      drops_layers_ || options_.gradient_as_bucket_view || gradients_stay_local_ ||
      !options_.overlap_with_backward || static_graph_.learning()) {
    return none;
  }
  double total = 0;
  for (const auto& bucket : buckets) {
    total += static_cast<double>(bucket.flat.nbytes());
  }
  double held = 0;
  size_t first = none;
  while (first > 1 && held < forward_tail_ * total) {
    const Bucket& bucket = buckets[first - 1];
    if (bucket.sparse) {
      break;
    }
    held += static_cast<double>(bucket.flat.nbytes());
    --first;
  }
  return first;
}

std::vector<std::pair<size_t, std::vector<size_t>>> Reducer::deferred_buckets() const {
  const auto lock = lock_state(Access::kRead);
  std::vector<std::pair<size_t, std::vector<size_t>>> result;
  result.reserve(deferred_.size());
  for (const auto& deferred : deferred_) {
    result.emplace_back(deferred.index, deferred.param_indices);
  }
  return result;
}

void Reducer::finish_deferred(size_t bucket_index) {
  const auto lock = lock_state(Access::kChange);
  auto found = std::find_if(deferred_.begin(), deferred_.end(), [&](const DeferredBucket& d) {
    return d.index == bucket_index;
  });
  if (found == deferred_.end()) {
    return;
  }
  DeferredBucket deferred = std::move(*found);
  deferred_.erase(found);
  if (deferred.work) {
    wait_for_work(*deferred.work, deferred.index);
  }
  write_back_views(deferred.views, deferred.param_indices, deferred_usage_, /*as_view=*/false);
}

void Reducer::check_nothing_deferred(const char* what) const {
  TORCH_CHECK(
      deferred_.empty(),
      "DistributedDataParallel on rank ", process_group_->getRank(), " cannot start ", what,
      " while ", deferred_.size(), " bucket(s) of the last backward are still being "
      "reduced for the forward overlap; finish them first (ddp.finish_forward_tail())");
}

} // namespace ddp_ext::reducer
