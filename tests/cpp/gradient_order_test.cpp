// Gradient order prediction, the pure pieces (reducer/layout/gradient_order.h):
// bucket assignment for an observed order, the overlap measure, the watch's
// hysteresis and the consensus rule. See Note [Gradient order prediction].
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "tests/cpp/tensor_specs.h"
#include "reducer/layout/gradient_order.h"

namespace ddp_ext::reducer {
namespace {

using Buckets = std::vector<std::vector<size_t>>;

using testing::floats;
using testing::spec;

OrderCost cost_of(const Buckets& buckets, const std::vector<size_t>& order,
                  const std::vector<int64_t>& bytes) {
  return order_cost(bucket_of_params(buckets, bytes.size()), buckets.size(), order, bytes);
}

struct InOrderRow {
  const char* name;
  std::vector<TensorSpec> tensors;
  std::vector<size_t> order;
  std::vector<int64_t> caps;
  std::vector<bool> sparse;
  Buckets expected;
};

TEST(GradientOrder, AssignInOrderTable) {
  const auto f64 = c10::ScalarType::Double;
  const std::vector<InOrderRow> rows = {
      {"in_order_one_kind", floats({4, 4, 4, 4}), {0, 1, 2, 3}, {8}, {}, {{0, 1}, {2, 3}}},
      {"reverse_order_is_the_construction_layout", floats({4, 4, 4}), {2, 1, 0}, {100}, {},
       {{2, 1, 0}}},
      {"shuffled", floats({4, 4, 4, 4}), {2, 0, 3, 1}, {8}, {}, {{2, 0}, {3, 1}}},
      {"first_bucket_keeps_small_cap", floats({4, 4, 4, 4, 4}), {4, 0, 3, 1, 2}, {4, 100}, {},
       {{4}, {0, 3, 1, 2}}},
      {"oversized_closes_its_bucket", floats({4, 100, 4}), {0, 1, 2}, {8}, {}, {{0, 1}, {2}}},
      // f32 opens first, but the f64 bucket is full first, so it launches first.
      {"kinds_launch_when_full", {spec(4), spec(8, f64), spec(4), spec(8, f64)}, {0, 1, 3, 2},
       {100}, {}, {{1, 3}, {0, 2}}},
      {"sparse_alone_where_it_arrives", floats({4, 4, 4}), {0, 1, 2}, {100},
       {false, true, false}, {{1}, {0, 2}}},
  };
  for (InOrderRow row : rows) {
    for (size_t i = 0; i < row.sparse.size(); ++i) {
      row.tensors[i].sparse = row.sparse[i];
    }
    EXPECT_EQ(assign_buckets_in_order(row.tensors, row.order, row.caps), row.expected) << row.name;
  }
}

TEST(GradientOrder, ReverseOrderGivesTheConstructionLayout) {
  std::mt19937 rng(1);
  const std::vector<int64_t> sizes = {1, 4, 16, 64};
  const std::vector<int64_t> caps = {4, 16, 100};
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<int64_t> nbytes(1 + rng() % 20);
    for (auto& n : nbytes) {
      n = sizes[rng() % sizes.size()];
    }
    const auto tensors = floats(nbytes);
    const int64_t cap = caps[rng() % caps.size()];
    std::vector<size_t> order(tensors.size());
    std::iota(order.rbegin(), order.rend(), 0);
    EXPECT_EQ(assign_buckets_in_order(tensors, order, {cap}), assign_buckets(tensors, cap, cap));
  }
}

TEST(GradientOrder, AssignInOrderInvariantsOnRandomOrders) {
  std::mt19937 rng(0);
  const std::vector<int64_t> sizes = {0, 4, 16, 64};
  const std::vector<int64_t> caps = {1, 16, 64, 1000};
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<TensorSpec> tensors(1 + rng() % 25);
    for (auto& t : tensors) {
      t = spec(sizes[rng() % sizes.size()],
               rng() % 2 ? c10::ScalarType::Float : c10::ScalarType::Double);
    }
    std::vector<size_t> order(tensors.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const int64_t cap = caps[rng() % caps.size()];
    const Buckets buckets = assign_buckets_in_order(tensors, order, {cap});
    std::vector<size_t> position(tensors.size());
    for (size_t k = 0; k < order.size(); ++k) {
      position[order[k]] = k;
    }
    std::vector<size_t> seen;
    std::vector<size_t> completed;
    for (const auto& bucket : buckets) {
      seen.insert(seen.end(), bucket.begin(), bucket.end());
      size_t last = 0;
      int64_t size = 0;
      for (size_t k = 0; k < bucket.size(); ++k) {
        EXPECT_EQ(tensors[bucket[k]].dtype, tensors[bucket.front()].dtype) << "mixes dtypes";
        if (k > 0) {
          EXPECT_LT(position[bucket[k - 1]], position[bucket[k]]) << "not in arrival order";
        }
        last = std::max(last, position[bucket[k]]);
        size += tensors[bucket[k]].nbytes;
      }
      EXPECT_LT(size - tensors[bucket.back()].nbytes, cap) << "took a tensor past its cap";
      completed.push_back(last);
    }
    EXPECT_TRUE(std::is_sorted(completed.begin(), completed.end()))
        << "buckets must launch in the order they fill";
    std::sort(seen.begin(), seen.end());
    std::vector<size_t> all(tensors.size());
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(seen, all);
  }
}

TEST(GradientOrder, AssignInOrderNeedsAPermutation) {
  const std::vector<std::vector<size_t>> bad = {{0, 1}, {0, 0, 1}, {0, 1, 3}};
  for (const auto& order : bad) {
    try {
      assign_buckets_in_order(floats({4, 4, 4}), order, {100});
      ADD_FAILURE() << "an order of " << order.size() << " entries was accepted";
    } catch (const c10::Error& error) {
      EXPECT_NE(std::string(error.what()).find("gradient order must name each"), std::string::npos);
    }
  }
}

struct CostRow {
  const char* name;
  Buckets buckets; // in launch order
  std::vector<size_t> order; // arrival order
  std::vector<int64_t> bytes;
  double wait;
  double overlap_fraction;
};

TEST(GradientOrder, CostTable) {
  const std::vector<CostRow> rows = {
      // One bucket: the first gradient waits for the second; nothing launches early.
      {"one_bucket", {{0, 1}}, {0, 1}, {1, 1}, 1.0 / 4, 0.0},
      {"one_per_gradient_in_order", {{0}, {1}}, {0, 1}, {1, 1}, 0.0, 0.5},
      {"one_per_gradient_reversed", {{1}, {0}}, {0, 1}, {1, 1}, 1.0 / 4, 0.0},
      {"two_buckets_in_order", {{0, 1}, {2, 3}}, {0, 1, 2, 3}, {1, 1, 1, 1}, 2.0 / 16, 0.5},
      // The first bucket fills last: everything waits for the end.
      {"two_buckets_reversed", {{0, 1}, {2, 3}}, {2, 3, 0, 1}, {1, 1, 1, 1}, 6.0 / 16, 0.0},
      // Waits weigh by bytes: 1 byte waits for 3 that arrive after it.
      {"weighted_by_bytes", {{0}, {1}}, {1, 0}, {3, 1}, 3.0 / 16, 0.0},
      {"no_bytes", {{0, 1}}, {1, 0}, {0, 0}, 0.0, 0.0},
  };
  for (const CostRow& row : rows) {
    const OrderCost cost = cost_of(row.buckets, row.order, row.bytes);
    EXPECT_NEAR(cost.wait, row.wait, 1e-12) << row.name;
    EXPECT_NEAR(cost.overlap_fraction, row.overlap_fraction, 1e-12) << row.name;
  }
}

TEST(GradientOrder, ALayoutBuiltFromTheOrderCostsNoMoreThanAnyOther) {
  std::mt19937 rng(2);
  const std::vector<int64_t> sizes = {4, 16, 64};
  const std::vector<int64_t> caps = {16, 64, 128};
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<int64_t> nbytes(2 + rng() % 15);
    for (auto& n : nbytes) {
      n = sizes[rng() % sizes.size()];
    }
    std::vector<size_t> order(nbytes.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const int64_t cap = caps[rng() % caps.size()];
    const auto tensors = floats(nbytes);
    const Buckets fitted = assign_buckets_in_order(tensors, order, {cap});
    const Buckets guessed = assign_buckets(tensors, cap, cap);
    EXPECT_LE(cost_of(fitted, order, nbytes).wait, cost_of(guessed, order, nbytes).wait + 1e-12);
  }
}

// A power of two: gains at the threshold compare exactly.
constexpr double kExactGain = 0.0625;

struct WatchRow {
  const char* name;
  int streak;
  double current, candidate, fresh;
  int patience;
  WatchStep expected;
};

TEST(GradientOrder, WatchTable) {
  const std::vector<WatchRow> rows = {
      {"fresh_gains_starts_streak", 0, 0.5, 0.5, 0.1, 3, {1, true, false}},
      {"fresh_gains_too_little", 0, 0.5, 0.5, 0.45, 3, {0, false, false}},
      {"gain_exactly_at_threshold_counts", 0, 0.5, 0.5, 0.5 - kExactGain, 3, {1, true, false}},
      {"candidate_keeps_gaining", 1, 0.5, 0.1, 0.1, 3, {2, false, false}},
      {"patience_reached_votes", 2, 0.5, 0.1, 0.1, 3, {3, false, true}},
      {"keeps_voting", 7, 0.5, 0.1, 0.1, 3, {8, false, true}},
      // The order went back: the candidate loses, and the current layout fits.
      {"candidate_loses_streak_ends", 2, 0.1, 0.4, 0.1, 3, {0, false, false}},
      // The order changed again: the candidate loses, a new one starts.
      {"candidate_loses_fresh_restarts", 2, 0.5, 0.48, 0.1, 3, {1, true, false}},
      {"patience_one_votes_at_once", 0, 0.5, 0.5, 0.0, 1, {1, true, true}},
  };
  for (const WatchRow& row : rows) {
    const WatchStep step = watch_step(row.streak, row.current, row.candidate, row.fresh,
                                      RebuildPolicy{row.patience, kExactGain});
    EXPECT_EQ(std::make_tuple(step.streak, step.adopt_fresh, step.vote),
              std::make_tuple(row.expected.streak, row.expected.adopt_fresh, row.expected.vote))
        << row.name;
  }
}

// Orders A, B, A, B, ... under a layout that fits A never vote; B repeated
// votes after `patience` iterations.
TEST(GradientOrder, AlternatingOrdersNeverVote) {
  const double a_fits = 0.05, b_fits = 0.45; // cost of A's and B's layouts under order B
  const RebuildPolicy policy;
  int streak = 0;
  for (char order : std::string("ABABABAB")) {
    const double current = order == 'A' ? 0.0 : b_fits;
    const double candidate = order == 'A' ? 0.4 : a_fits;
    const double fresh = order == 'A' ? 0.0 : a_fits;
    const WatchStep step = watch_step(streak, current, candidate, fresh, policy);
    streak = step.streak;
    EXPECT_FALSE(step.vote) << "order " << order;
  }
  streak = 0;
  std::vector<bool> votes;
  for (int i = 0; i < 4; ++i) {
    const WatchStep step = watch_step(streak, b_fits, a_fits, a_fits, policy);
    streak = step.streak;
    votes.push_back(step.vote);
  }
  EXPECT_EQ(votes, (std::vector<bool>{false, false, true, true}));
}

TEST(GradientOrder, ARebuildNeedsEveryRank) {
  const std::vector<std::tuple<int64_t, int64_t, bool>> rows = {
      {2, 2, true}, {1, 2, false}, {0, 2, false}, {3, 3, true},
      {2, 3, false}, {1, 1, true}, {0, 1, false}, {0, 0, false}};
  for (const auto& [votes, ranks, agreed] : rows) {
    EXPECT_EQ(rebuild_agreed(votes, ranks), agreed) << votes << " of " << ranks;
  }
}

// The layout a repeated order would get is laid out once and kept; new caps
// forget it. Four gradients of 4 bytes arrive first to last, while the
// current layout (one per bucket) launches the last one's bucket first, so
// every gradient waits for the end. Under one cap that holds them all, a
// fresh layout gains nothing (one bucket also waits for the end): no vote,
// however often the order repeats. After set_caps to one gradient per
// bucket, the same order is laid out again and gains: a vote after
// `patience` iterations.
TEST(GradientOrder, NewCapsLayTheRepeatedOrderOutAgain) {
  const std::vector<size_t> reversed_layout = {3, 2, 1, 0}; // bucket of each parameter
  const RebuildPolicy policy;
  GradientOrder order(floats({4, 4, 4, 4}), {1 << 20}, BucketRebuild::kContinuous, policy);
  order.set_first_rebuild(false);
  auto iterate = [&] {
    order.begin_iteration();
    for (size_t index = 0; index < 4; ++index) {
      order.record(index);
    }
    order.observe(reversed_layout, 4, /*launched_at_end=*/false);
    order.update_vote(reversed_layout, 4);
    return order.vote();
  };
  for (int i = 0; i < 2 * policy.patience; ++i) {
    EXPECT_EQ(iterate(), 0) << "one bucket under the large cap, iteration " << i;
  }
  order.set_caps({4});
  std::vector<int64_t> votes;
  for (int i = 0; i < policy.patience; ++i) {
    votes.push_back(iterate());
  }
  std::vector<int64_t> expected(policy.patience, 0);
  expected.back() = 1;
  EXPECT_EQ(votes, expected);
}

// The first rebuild falls due after the first synchronising backward, or
// after the second with a static graph (whose learning iteration records no
// order in torch's DDP), and takes that backward's order; a shadowed
// backward (Join) counts as one, and a restart (new process group) skips
// none, as torch's static graph learns only once.
TEST(GradientOrder, FirstRebuildSkipsTheStaticGraphsLearningIteration) {
  const std::vector<size_t> one_bucket = {0, 0, 0};
  const auto backward = [&](GradientOrder& order, const std::vector<size_t>& ready) {
    order.begin_iteration();
    for (size_t index : ready) {
      order.record(index);
    }
    order.observe(one_bucket, 1, /*launched_at_end=*/false);
    order.update_vote(one_bucket, 1);
  };
  for (int skipped : {0, 1}) {
    GradientOrder order(floats({4, 4, 4}), {1 << 20}, BucketRebuild::kOnce);
    order.set_first_rebuild(true, skipped);
    backward(order, {2, 1, 0});
    EXPECT_EQ(order.first_rebuild_due(), skipped == 0) << "skipped " << skipped;
    backward(order, {1, 2, 0});
    EXPECT_TRUE(order.first_rebuild_due()) << "skipped " << skipped;
    const std::vector<size_t> first = skipped == 0 ? std::vector<size_t>{2, 1, 0}
                                                   : std::vector<size_t>{1, 2, 0};
    EXPECT_EQ(order.first_order(), first) << "skipped " << skipped;
  }
  GradientOrder joined(floats({4, 4, 4}), {1 << 20}, BucketRebuild::kOnce);
  joined.set_first_rebuild(true, 1);
  joined.shadowed_backward();
  EXPECT_FALSE(joined.first_rebuild_due());
  joined.shadowed_backward();
  EXPECT_TRUE(joined.first_rebuild_due());
  GradientOrder restarted(floats({4, 4, 4}), {1 << 20}, BucketRebuild::kOnce);
  restarted.set_first_rebuild(true, 1);
  restarted.restart();
  backward(restarted, {2, 1, 0});
  EXPECT_TRUE(restarted.first_rebuild_due());
}

} // namespace
} // namespace ddp_ext::reducer
