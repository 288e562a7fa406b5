#include "reducer/layout/gradient_order.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

namespace ddp_ext::reducer {

namespace {

constexpr size_t kNotPlaced = std::numeric_limits<size_t>::max();

} // namespace

OrderCost order_cost(
    const std::vector<size_t>& bucket_of,
    size_t buckets,
    const std::vector<size_t>& order,
    const std::vector<int64_t>& bytes) {
  const size_t n = order.size();
  TORCH_CHECK(bucket_of.size() == n && bytes.size() == n,
              "order_cost needs one bucket and one size per parameter");
  OrderCost cost;
  if (n == 0) {
    return cost;
  }
  // arrived[k]: bytes arrived up to and including position k.
  std::vector<size_t> position(n);
  std::vector<int64_t> arrived(n);
  int64_t total = 0;
  for (size_t k = 0; k < n; ++k) {
    position[order[k]] = k;
    total += bytes[order[k]];
    arrived[k] = total;
  }
  if (total == 0) {
    return cost;
  }
  // A bucket launches once it is complete and every earlier one launched.
  std::vector<size_t> launch(buckets, 0);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(bucket_of[i] < buckets, "parameter ", i, " is in no bucket");
    launch[bucket_of[i]] = std::max(launch[bucket_of[i]], position[i]);
  }
  for (size_t b = 1; b < buckets; ++b) {
    launch[b] = std::max(launch[b], launch[b - 1]);
  }
  double waited = 0;
  int64_t late = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t at = launch[bucket_of[i]];
    waited += static_cast<double>(bytes[i]) *
        static_cast<double>(arrived[at] - arrived[position[i]]);
    if (at == n - 1) {
      late += bytes[i];
    }
  }
  const double all = static_cast<double>(total);
  cost.wait = waited / (all * all);
  cost.overlap_fraction = 1.0 - static_cast<double>(late) / all;
  return cost;
}

std::vector<size_t> bucket_of_params(
    const std::vector<std::vector<size_t>>& buckets, size_t params) {
  std::vector<size_t> bucket_of(params, kNotPlaced);
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (size_t index : buckets[b]) {
      TORCH_CHECK(index < params, "bucket holds parameter ", index, " of ", params);
      bucket_of[index] = b;
    }
  }
  return bucket_of;
}

WatchStep watch_step(
    int streak,
    double current,
    double candidate,
    double fresh,
    const RebuildPolicy& policy) {
  WatchStep step;
  if (streak > 0 && current - candidate >= policy.min_gain) {
    step.streak = streak + 1;
  } else if (current - fresh >= policy.min_gain) {
    step.streak = 1;
    step.adopt_fresh = true;
  }
  step.vote = step.streak >= policy.patience;
  return step;
}

bool rebuild_agreed(int64_t summed_votes, int64_t ranks) {
  return ranks > 0 && summed_votes == ranks;
}

GradientOrder::GradientOrder(
    std::vector<TensorSpec> specs,
    std::vector<int64_t> caps,
    BucketRebuild mode,
    RebuildPolicy policy)
    : specs_(std::move(specs)),
      caps_(std::move(caps)),
      mode_(mode),
      policy_(policy) {
  TORCH_CHECK(mode_ == BucketRebuild::kNever || !caps_.empty(),
              "rebuilding buckets needs the bucket caps");
  bytes_.reserve(specs_.size());
  for (const auto& spec : specs_) {
    bytes_.push_back(spec.nbytes);
  }
  stamps_.assign(specs_.size(), -1);
  dropped_.assign(specs_.size(), false);
}

void GradientOrder::set_first_rebuild(bool due, int skipped_backwards) {
  first_due_ = due;
  first_skips_ = skipped_backwards;
}

void GradientOrder::allow_continuous(bool allowed) {
  continuous_allowed_ = allowed;
}

bool GradientOrder::watching() const {
  return mode_ == BucketRebuild::kContinuous && continuous_allowed_ &&
      (first_done_ || !first_due_);
}

bool GradientOrder::first_pending() const {
  return mode_ != BucketRebuild::kNever && first_due_ && !first_done_;
}

bool GradientOrder::consulting() const {
  return watching(); // the first rebuild is not voted on; see the Note
}

int64_t GradientOrder::vote() const {
  return consulting() && vote_ ? 1 : 0;
}

void GradientOrder::begin_iteration() {
  std::fill(stamps_.begin(), stamps_.end(), -1);
  clock_ = 0;
  for (size_t index : dropped_indices_) {
    dropped_[index] = false;
  }
  dropped_indices_.clear();
}

void GradientOrder::record_dropped(size_t index) {
  if (!dropped_[index]) {
    dropped_[index] = true;
    dropped_indices_.push_back(index);
  }
}

void GradientOrder::set_layout(const std::vector<std::vector<size_t>>& buckets) {
  layout_order_.clear();
  for (const auto& bucket : buckets) {
    layout_order_.insert(layout_order_.end(), bucket.begin(), bucket.end());
  }
}

void GradientOrder::derive_order() {
  const size_t n = stamps_.size();
  order_.assign(n, kNotPlaced);
  // Usually every parameter was stamped once: its stamp is its position.
  bool placed = clock_ == static_cast<int64_t>(n);
  for (size_t i = 0; placed && i < n; ++i) {
    const int64_t stamp = stamps_[i];
    placed = stamp >= 0 && order_[stamp] == kNotPlaced;
    if (placed) {
      order_[stamp] = i;
    }
  }
  if (!placed) {
    // Learning iteration: repeated or missing stamps. Unstamped (-1) first.
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [this](size_t a, size_t b) {
      return stamps_[a] < stamps_[b];
    });
  }
  if (!dropped_indices_.empty()) {
    place_dropped();
  }
}

void GradientOrder::place_dropped() {
  // See the Note: each dropped parameter follows its predecessor in the
  // current layout (those with none lead).
  const size_t n = stamps_.size();
  std::vector<std::vector<size_t>> followers(n + 1); // [n]: the leaders
  size_t anchor = n;
  for (size_t index : layout_order_) {
    if (dropped_[index]) {
      followers[anchor].push_back(index);
    } else {
      anchor = index;
    }
  }
  std::vector<size_t> order = followers[n];
  order.reserve(n);
  for (size_t index : order_) {
    if (!dropped_[index]) {
      order.push_back(index);
      order.insert(order.end(), followers[index].begin(), followers[index].end());
    }
  }
  TORCH_INTERNAL_ASSERT(order.size() == n, "a dropped parameter is in no bucket");
  order_ = std::move(order);
}

void GradientOrder::observe(
    const std::vector<size_t>& bucket_of, size_t buckets, bool launched_at_end) {
  derive_order();
  ++observed_;
  last_cost_ = order_cost(bucket_of, buckets, order_, bytes_);
  if (launched_at_end) {
    // Every gradient waited for the end: what a single bucket costs.
    const std::vector<size_t> one_bucket(order_.size(), 0);
    last_cost_ = order_cost(one_bucket, 1, order_, bytes_);
  }
}

void GradientOrder::update_vote(const std::vector<size_t>& bucket_of, size_t buckets) {
  if (observed_ == 0) {
    return;
  }
  if (first_pending()) {
    // The first rebuild, as torch's DDP: to the first observed order, at
    // the next forward (see the Note).
    vote_ = false;
    if (first_skips_ > 0) {
      --first_skips_; // a static graph's learning iteration
      return;
    }
    if (voted_order_.empty()) {
      voted_order_ = order_;
    }
    first_ready_ = true;
    return;
  }
  if (!watching()) {
    vote_ = false;
    return;
  }
  const double current = order_cost(bucket_of, buckets, order_, bytes_).wait;
  const double candidate = streak_ > 0
      ? order_cost(candidate_bucket_of_, candidate_buckets_, order_, bytes_).wait
      : current;
  // A fresh layout costs at least 0: it cannot gain more than `current`.
  const bool consider_fresh = current >= policy_.min_gain;
  const double fresh = consider_fresh ? fresh_layout().wait : current;
  const WatchStep step = watch_step(streak_, current, candidate, fresh, policy_);
  if (step.adopt_fresh) {
    TORCH_INTERNAL_ASSERT(consider_fresh, "adopted a fresh layout that was not laid out");
    candidate_order_ = order_;
    candidate_bucket_of_ = fresh_.bucket_of;
    candidate_buckets_ = fresh_.buckets;
  }
  streak_ = step.streak;
  vote_ = step.vote;
  if (vote_) {
    voted_order_ = candidate_order_;
  }
}

const GradientOrder::FreshLayout& GradientOrder::fresh_layout() {
  if (fresh_.order != order_) {
    const std::vector<std::vector<size_t>> layout = layout_for(order_);
    fresh_.order = order_;
    fresh_.bucket_of = bucket_of_params(layout, order_.size());
    fresh_.buckets = layout.size();
    fresh_.wait = order_cost(fresh_.bucket_of, fresh_.buckets, order_, bytes_).wait;
  }
  return fresh_;
}

std::vector<std::vector<size_t>> GradientOrder::layout_for(
    const std::vector<size_t>& order) const {
  return assign_buckets_in_order(specs_, order, caps_);
}

std::vector<std::vector<size_t>> GradientOrder::layout_for(
    const std::vector<size_t>& order, const std::vector<int64_t>& caps) const {
  return assign_buckets_in_order(specs_, order, caps);
}

void GradientOrder::set_caps(std::vector<int64_t> caps) {
  TORCH_CHECK(!caps.empty(), "set_caps needs at least one cap");
  caps_ = std::move(caps);
  fresh_ = FreshLayout(); // laid out with the old caps
  forget_candidate();
  if (!first_pending()) {
    vote_ = false;
    voted_order_.clear();
  }
}

void GradientOrder::forget_candidate() {
  streak_ = 0;
  candidate_order_.clear();
  candidate_bucket_of_.clear();
  candidate_buckets_ = 0;
}

void GradientOrder::shadowed_backward() {
  if (first_pending()) {
    if (first_skips_ > 0) {
      --first_skips_; // the peers' learning iteration
    } else {
      first_ready_ = true;
    }
  }
}

void GradientOrder::restart() {
  rebuilt(false);
  first_done_ = false;
  first_ready_ = false;
  first_skips_ = 0; // torch's static graph learns in its first iteration only
}

void GradientOrder::rebuilt(bool changed) {
  first_done_ = true;
  forget_candidate();
  vote_ = false;
  voted_order_.clear();
  if (changed) {
    ++rebuilds_;
  }
}

} // namespace ddp_ext::reducer
