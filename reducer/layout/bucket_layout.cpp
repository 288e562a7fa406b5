#include "reducer/layout/bucket_layout.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "reducer/layout/bucket_assignment.h"

namespace ddp_ext::reducer {

namespace {

constexpr size_t kUnassigned = std::numeric_limits<size_t>::max();

// See Note [Agreeing on the bucket layout], point 1.
std::vector<std::vector<size_t>> first_layout(
    const std::vector<TensorSpec>& specs, const ReducerOptions& options) {
  if (options.first_layout_caps.empty()) {
    return assign_buckets(specs, options.bucket_caps);
  }
  return assign_buckets_as_torch_first(specs, options.first_layout_caps);
}

} // namespace

std::vector<TensorSpec> tensor_specs(
    const std::vector<at::Tensor>& params,
    std::optional<c10::ScalarType> reduce_dtype,
    const std::vector<bool>& sparse,
    const std::vector<int64_t>& units) {
  TORCH_CHECK(units.empty() || units.size() == params.size(), "Reducer got ",
              units.size(), " layer units for ", params.size(), " parameters");
  std::vector<TensorSpec> specs;
  specs.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& param = params[i];
    const auto bucket_dtype = reduce_dtype.value_or(param.scalar_type());
    specs.push_back(TensorSpec{
        param.numel() * static_cast<int64_t>(c10::elementSize(bucket_dtype)),
        param.scalar_type(), param.device(), !sparse.empty() && sparse.at(i),
        units.empty() ? -1 : units[i]});
  }
  return specs;
}

BucketLayout::BucketLayout(
    const std::vector<at::Tensor>& params,
    const std::vector<std::string>& names,
    const std::vector<bool>& sparse,
    const ReducerOptions& options)
    : params_(params),
      names_(names),
      sparse_(sparse),
      reduce_dtype_(options.reduce_dtype),
      gradient_as_bucket_view_(options.gradient_as_bucket_view),
      order_(
          tensor_specs(params, options.reduce_dtype, sparse, options.layer_units),
          options.bucket_caps,
          options.rebuild_buckets) {
  TORCH_CHECK(!options.bucket_caps.empty(), "Reducer needs the bucket caps");
  for (int64_t cap : options.bucket_caps) {
    TORCH_CHECK(cap > 0, "bucket caps are positive byte counts, got ", cap);
  }
  buckets_ = lay_out_buckets(inputs(), first_layout(order_.specs(), options), arenas_);
  index_buckets();
  if (!gradient_as_bucket_view_) {
    return;
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    const Bucket& bucket = buckets_[bucket_of_param_[i]];
    if (grad.defined() && !bucket.sparse) {
      const at::Tensor& view = bucket.views[slot_of_param_[i]];
      view.copy_(grad);
      grad = view;
    }
  }
}

LayoutInputs BucketLayout::inputs() const {
  return LayoutInputs{params_, names_, sparse_, reduce_dtype_, gradient_as_bucket_view_, separate_};
}

void BucketLayout::separate_buckets() {
  if (separate_) {
    return;
  }
  separate_ = true;
  buckets_ = lay_out_buckets(inputs(), indices(), arenas_);
  index_buckets();
  arenas_.clear(); // a .grad that is a view of one keeps it alive
}

void BucketLayout::index_buckets() {
  const size_t n = params_.size();
  bucket_of_param_.assign(n, kUnassigned);
  slot_of_param_.assign(n, kUnassigned);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& members = buckets_[b].param_indices;
    for (size_t slot = 0; slot < members.size(); ++slot) {
      bucket_of_param_[members[slot]] = b;
      slot_of_param_[members[slot]] = slot;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(bucket_of_param_[i] != kUnassigned, "parameter ", names_[i],
                " is in no bucket");
  }
  order_.set_layout(indices());
}

std::vector<std::vector<size_t>> BucketLayout::indices() const {
  std::vector<std::vector<size_t>> result;
  result.reserve(buckets_.size());
  for (const auto& bucket : buckets_) {
    result.push_back(bucket.param_indices);
  }
  return result;
}

std::vector<int64_t> BucketLayout::sizes() const {
  std::vector<int64_t> result;
  result.reserve(buckets_.size());
  for (const auto& bucket : buckets_) {
    const at::Tensor& param = bucket.params.front();
    result.push_back(
        bucket.sparse ? param.numel() * param.element_size()
                      : bucket.flat.numel() * bucket.flat.element_size());
  }
  return result;
}

std::vector<size_t> BucketLayout::current_order() const {
  std::vector<size_t> order;
  order.reserve(params_.size());
  for (const Bucket& bucket : buckets_) {
    order.insert(order.end(), bucket.param_indices.begin(), bucket.param_indices.end());
  }
  return order;
}

std::vector<std::vector<size_t>> BucketLayout::layout_for_caps(
    const std::vector<int64_t>& caps) const {
  return order_.layout_for(current_order(), caps);
}

bool BucketLayout::set_caps(const std::vector<int64_t>& caps, Timeline& timeline) {
  TORCH_CHECK(!caps.empty(), "set_bucket_caps needs at least one cap");
  for (int64_t cap : caps) {
    TORCH_CHECK(cap > 0, "bucket caps are positive byte counts, got ", cap);
  }
  // See the Note, point 3: the buckets keep their (agreed) order; only where
  // they are cut changes.
  const auto layout = layout_for_caps(caps);
  order_.set_caps(caps);
  return rebuild(layout, timeline);
}

int64_t BucketLayout::cast_vote() {
  vote_cast_ = order_.consulting();
  own_vote_ = vote_cast_ ? order_.vote() : 0;
  return own_vote_;
}

bool BucketLayout::conclude(
    bool launched_at_end,
    std::optional<int64_t> summed_votes,
    c10d::ProcessGroup& group,
    Timeline& timeline,
    StallWatch* watch) {
  order_.observe(bucket_of_param_, buckets_.size(), launched_at_end);
  bool changed = false;
  if (vote_cast_) {
    vote_cast_ = false;
    if (rebuild_agreed(summed_votes.value_or(own_vote_), group.getSize())) {
      changed = rebuild(
          order_.layout_for(agreed_order(order_.voted_order(), group, watch, "layout broadcast")), timeline);
      order_.rebuilt(changed);
    }
  }
  order_.update_vote(bucket_of_param_, buckets_.size());
  return changed;
}

BucketLayout::FirstRebuild BucketLayout::rebuild_first(
    c10d::ProcessGroup& group, Timeline& timeline, StallWatch* watch) {
  FirstRebuild result;
  if (!order_.first_rebuild_due()) {
    return result;
  }
  // See the Note, point 2. A rank that shadowed the backward has no order:
  // it receives rank 0's; if it is rank 0, it sends its current layout's.
  const std::vector<size_t> mine =
      order_.first_order().empty() ? current_order() : order_.first_order();
  result.changed = rebuild(order_.layout_for(agreed_order(mine, group, watch, "first layout broadcast")), timeline);
  order_.rebuilt(result.changed);
  result.done = true;
  return result;
}

std::vector<size_t> BucketLayout::agreed_order(
    const std::vector<size_t>& mine,
    c10d::ProcessGroup& group,
    StallWatch* watch,
    const char* waiting_for) const {
  // Rank 0's order is the one; every rank sends one of the same length.
  TORCH_INTERNAL_ASSERT(mine.size() == params_.size());
  at::Tensor order = at::empty({static_cast<int64_t>(mine.size())}, at::kLong);
  int64_t* values = order.data_ptr<int64_t>();
  for (size_t k = 0; k < mine.size(); ++k) {
    values[k] = static_cast<int64_t>(mine[k]);
  }
  if (group.getSize() > 1) {
    std::vector<at::Tensor> tensors{order.to(params_.front().device())};
    c10d::BroadcastOptions from_rank_0;
    from_rank_0.rootRank = 0;
    auto work = group.broadcast(tensors, from_rank_0);
    if (watch != nullptr) {
      watch->wait(*work, waiting_for, -1);
    } else {
      work->wait();
    }
    order = tensors.front().cpu();
    values = order.data_ptr<int64_t>();
  }
  std::vector<size_t> agreed(mine.size());
  for (size_t k = 0; k < agreed.size(); ++k) {
    TORCH_CHECK(values[k] >= 0 && static_cast<size_t>(values[k]) < agreed.size(),
                "the broadcast gradient order holds ", values[k], " for ",
                agreed.size(), " parameters");
    agreed[k] = static_cast<size_t>(values[k]);
  }
  return agreed;
}

bool BucketLayout::rebuild(
    const std::vector<std::vector<size_t>>& layout, Timeline& timeline) {
  const bool changed = !std::equal(
      layout.begin(), layout.end(), buckets_.begin(), buckets_.end(),
      [](const std::vector<size_t>& members, const Bucket& bucket) {
        return members == bucket.param_indices;
      });
  if (!changed) {
    return false;
  }
  // See Note [Gradient order prediction] for why this point is safe, and
  // Note [Bucket memory] for where the buckets' memory comes from.
  TimelineRange range(timeline, TimelineEvent::kRebuild);
  std::vector<Bucket> old = std::move(buckets_);
  if (!gradient_as_bucket_view_) {
    buckets_ = lay_out_buckets(inputs(), layout, arenas_);
    index_buckets();
    range.set_value(static_cast<int64_t>(buckets_.size()));
    return true;
  }
  std::vector<at::Tensor> arenas;
  buckets_ = lay_out_buckets(inputs(), layout, arenas);
  index_buckets();
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
  range.set_value(static_cast<int64_t>(buckets_.size()));
  return true;
}

} // namespace ddp_ext::reducer
