// The Reducer's side of gradient order prediction: casting its vote, and
// rebuilding the buckets when every rank agreed. The bookkeeping and the
// decision live in reducer/gradient_order.h; see Note [Gradient order
// prediction] there. Also re-laying the buckets with other caps, which the
// wrapper's tuner decides (Note [Auto-tuned bucket caps] in
// ddp_ext/_auto_buckets.py).

#include "reducer/reducer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <utility>

namespace ddp_ext::reducer {

bool Reducer::has_rebuilt_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gradient_order_.has_rebuilt();
}

int64_t Reducer::rebuilds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gradient_order_.rebuilds();
}

std::vector<size_t> Reducer::observed_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gradient_order_.last_order();
}

std::optional<double> Reducer::overlap_fraction() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (gradient_order_.observed_iterations() == 0) {
    return std::nullopt;
  }
  return gradient_order_.overlap_fraction();
}

std::optional<double> Reducer::launch_delay() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (gradient_order_.observed_iterations() == 0) {
    return std::nullopt;
  }
  return gradient_order_.launch_delay();
}

int64_t Reducer::cast_order_vote() {
  // See Note [Gradient order prediction]: the vote rides on the step check.
  order_vote_cast_ = gradient_order_.consulting();
  own_order_vote_ = order_vote_cast_ ? gradient_order_.vote() : 0;
  return own_order_vote_;
}

void Reducer::conclude_gradient_order(bool launched_at_end) {
  gradient_order_.observe(bucket_of_param_, buckets_.size(), launched_at_end);
  if (order_vote_cast_) {
    order_vote_cast_ = false;
    // The step check was awaited before the buckets (a world of one has none).
    const int64_t votes = step_check_ ? step_check_->summed_rider() : own_order_vote_;
    if (rebuild_agreed(votes, process_group_->getSize())) {
      const auto layout = gradient_order_.layout_for(agreed_order());
      const bool changed = !std::equal(
          layout.begin(), layout.end(), buckets_.begin(), buckets_.end(),
          [](const std::vector<size_t>& indices, const Bucket& bucket) {
            return indices == bucket.param_indices;
          });
      if (changed) {
        TimelineRange range(timeline_, TimelineEvent::kRebuild);
        rebuild_buckets(layout);
        range.set_value(static_cast<int64_t>(buckets_.size()));
      }
      gradient_order_.rebuilt(changed);
    }
  }
  gradient_order_.update_vote(bucket_of_param_, buckets_.size());
}

std::vector<size_t> Reducer::agreed_order() {
  // Every rank voted, so every rank has an order; rank 0's is the one.
  const auto& mine = gradient_order_.voted_order();
  TORCH_INTERNAL_ASSERT(mine.size() == params_.size());
  at::Tensor order = at::empty({static_cast<int64_t>(mine.size())}, at::kLong);
  int64_t* values = order.data_ptr<int64_t>();
  for (size_t k = 0; k < mine.size(); ++k) {
    values[k] = static_cast<int64_t>(mine[k]);
  }
  if (process_group_->getSize() > 1) {
    std::vector<at::Tensor> tensors{order.to(params_.front().device())};
    c10d::BroadcastOptions from_rank_0;
    from_rank_0.rootRank = 0;
    process_group_->broadcast(tensors, from_rank_0)->wait();
    order = tensors.front().cpu();
    values = order.data_ptr<int64_t>();
  }
  std::vector<size_t> agreed(mine.size());
  for (size_t k = 0; k < agreed.size(); ++k) {
    TORCH_CHECK(values[k] >= 0, "the broadcast gradient order holds ", values[k]);
    agreed[k] = static_cast<size_t>(values[k]);
  }
  return agreed;
}

void Reducer::rebuild_buckets(const std::vector<std::vector<size_t>>& layout) {
  // See Note [Gradient order prediction] for why this point is safe, and
  // Note [Bucket memory] for where the buckets' memory comes from.
  std::vector<Bucket> old = std::move(buckets_);
  if (!options_.gradient_as_bucket_view) {
    buckets_ = lay_out_buckets(layout_inputs(), layout, arenas_);
    index_buckets();
    next_bucket_ = 0;
    return;
  }
  std::vector<at::Tensor> arenas;
  buckets_ = lay_out_buckets(layout_inputs(), layout, arenas);
  index_buckets();
  next_bucket_ = 0;
  at::NoGradGuard no_grad;
  for (const Bucket& bucket : old) {
    for (size_t slot = 0; slot < bucket.views.size(); ++slot) {
      const size_t index = bucket.param_indices[slot];
      at::Tensor& grad = params_[index].mutable_grad();
      if (!grad.defined() || !is_bucket_view(grad, bucket.views[slot])) {
        continue; // not in the bucket: .grad stays as the user left it
      }
      const at::Tensor& view = buckets_[bucket_of_param_[index]].views[slot_of_param_[index]];
      view.copy_(grad);
      grad = view;
    }
  }
  arenas_ = std::move(arenas);
}

std::vector<size_t> Reducer::layout_order_locked() const {
  std::vector<size_t> order;
  order.reserve(params_.size());
  for (const Bucket& bucket : buckets_) {
    order.insert(order.end(), bucket.param_indices.begin(), bucket.param_indices.end());
  }
  return order;
}

std::vector<int64_t> Reducer::bucket_caps() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gradient_order_.caps();
}

std::vector<std::vector<size_t>> Reducer::layout_for_caps(
    const std::vector<int64_t>& caps) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gradient_order_.layout_for(layout_order_locked(), caps);
}

bool Reducer::set_bucket_caps(const std::vector<int64_t>& caps) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!caps.empty(), "set_bucket_caps needs at least one cap");
  for (int64_t cap : caps) {
    TORCH_CHECK(cap > 0, "bucket caps are positive byte counts, got ", cap);
  }
  TORCH_CHECK(
      phase_ != Phase::kReducing,
      "DistributedDataParallel on rank ", process_group_->getRank(),
      " cannot change its bucket caps while gradients are being reduced; "
      "change them between iterations");
  // The buckets keep their order (the agreed one, see Note [Gradient order
  // prediction]); only where they are cut changes. Safe for the reasons a
  // rebuild is: nothing is in flight, and .grad views move with the buckets.
  const auto layout = gradient_order_.layout_for(layout_order_locked(), caps);
  gradient_order_.set_caps(caps);
  options_.bucket_caps = caps;
  if (layout == bucket_indices_locked()) {
    return false;
  }
  TimelineRange range(timeline_, TimelineEvent::kRebuild);
  rebuild_buckets(layout);
  range.set_value(static_cast<int64_t>(buckets_.size()));
  if (phase_ == Phase::kExpectingGradients) {
    arm_buckets(); // a forward already armed the old buckets
  }
  return true;
}

} // namespace ddp_ext::reducer
