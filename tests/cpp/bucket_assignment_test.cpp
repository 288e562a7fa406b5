// Bucket assignment (reducer/layout/bucket_assignment.h): tables, invariants on
// random inputs, and agreement with torch's own bucketing.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "tests/cpp/tensor_specs.h"
#include "reducer/layout/bucket_assignment.h"

namespace ddp_ext::reducer {
namespace {

using Buckets = std::vector<std::vector<size_t>>;

const c10::Device kCpu(c10::DeviceType::CPU);
const c10::Device kGpu0(c10::DeviceType::CUDA, 0);
const c10::Device kGpu1(c10::DeviceType::CUDA, 1);

using testing::floats;
using testing::spec;

struct CapRow {
  const char* name;
  std::vector<TensorSpec> tensors;
  int64_t cap;
  int64_t first_cap; // 0: the same as cap
  Buckets expected;
};

TEST(BucketAssignment, Table) {
  const std::vector<CapRow> rows = {
      {"empty", {}, 100, 0, {}},
      {"one_tensor", floats({4}), 100, 0, {{0}}},
      {"all_fit_reverse_order", floats({4, 4, 4}), 100, 0, {{2, 1, 0}}},
      {"exactly_at_cap_fits", floats({4, 4, 4}), 8, 0, {{2, 1}, {0}}},
      {"cap_one_byte_one_each", floats({4, 4, 4}), 1, 0, {{2}, {1}, {0}}},
      {"closed_once_past_cap", floats({10, 10, 10, 10, 10}), 25, 0, {{4, 3, 2}, {1, 0}}},
      {"oversized_closes_its_bucket", floats({4, 100, 4}), 8, 0, {{2, 1}, {0}}},
      {"oversized_visited_first_alone", floats({4, 4, 100}), 8, 0, {{2}, {1, 0}}},
      {"zero_byte_tensors_follow_a_full_bucket", floats({0, 0, 4}), 4, 0, {{2}, {1, 0}}},
      {"zero_byte_tensors_join", floats({4, 0, 0}), 4, 0, {{2, 1, 0}}},
      {"dtypes_never_mix", {spec(4), spec(8, at::kDouble), spec(4), spec(8, at::kDouble)},
       100, 0, {{3, 1}, {2, 0}}},
      {"dtypes_capped_separately",
       {spec(4), spec(8, at::kDouble), spec(4), spec(8, at::kDouble), spec(4)},
       8, 0, {{4, 2}, {3}, {1}, {0}}},
      {"int_dtype_own_bucket", {spec(8, at::kLong), spec(4), spec(4)}, 100, 0, {{2, 1}, {0}}},
      {"devices_never_mix",
       {spec(4), spec(4, at::kFloat, kGpu0), spec(4, at::kFloat, kGpu1), spec(4)},
       100, 0, {{3, 0}, {2}, {1}}},
      {"same_dtype_other_device",
       {spec(4, at::kFloat, kGpu0), spec(4), spec(4, at::kFloat, kGpu0)}, 100, 0, {{2, 0}, {1}}},
      // The first bucket of each kind has a cap of its own.
      {"first_bucket_smaller", floats({4, 4, 4, 4, 4}), 100, 8, {{4, 3}, {2, 1, 0}}},
      {"first_cap_equal_to_cap", floats({4, 4, 4, 4, 4}), 8, 8, {{4, 3}, {2, 1}, {0}}},
      {"first_bucket_per_kind", {spec(4), spec(8, at::kDouble), spec(4), spec(8, at::kDouble)},
       100, 4, {{3}, {2}, {1}, {0}}},
      {"first_cap_larger_than_cap", floats({4, 4, 4, 4}), 4, 8, {{3, 2}, {1}, {0}}},
  };
  for (const CapRow& row : rows) {
    const int64_t first = row.first_cap == 0 ? row.cap : row.first_cap;
    EXPECT_EQ(assign_buckets(row.tensors, row.cap, first), row.expected) << row.name;
  }
}

TEST(BucketAssignment, RejectsNonPositiveCaps) {
  for (int64_t bad : {0, -1}) {
    EXPECT_THROW(assign_buckets(floats({4}), bad, bad), c10::Error);
    EXPECT_THROW(assign_buckets(floats({4}), 100, bad), c10::Error);
    try {
      assign_buckets(floats({4}), bad, 100);
      ADD_FAILURE() << "a cap of " << bad << " was accepted";
    } catch (const c10::Error& error) {
      EXPECT_NE(std::string(error.what()).find("bucket caps must be positive"), std::string::npos);
    }
  }
}

struct UnitRow {
  const char* name;
  std::vector<int64_t> nbytes;
  std::vector<int64_t> units; // empty: none
  std::vector<int64_t> caps;
  Buckets expected;
};

// Tensors of different droppable layers never share a bucket (Note [Layer
// dropping]), in the construction layout and in a rebuilt one.
TEST(BucketAssignment, KeepsLayersApart) {
  const std::vector<UnitRow> rows = {
      {"units_split_buckets", {4, 4, 4, 4}, {-1, 0, 0, -1}, {100}, {{3}, {2, 1}, {0}}},
      {"no_units_one_bucket", {4, 4, 4, 4}, {}, {100}, {{3, 2, 1, 0}}},
      {"layer_spans_buckets_at_the_cap", {4, 4, 4}, {0, 0, 0}, {8}, {{2, 1}, {0}}},
      {"first_cap_counts_across_units", {4, 4, 4, 4}, {1, 1, 0, 0}, {4, 100}, {{3}, {2}, {1, 0}}},
  };
  for (const UnitRow& row : rows) {
    std::vector<TensorSpec> specs = floats(row.nbytes);
    for (size_t i = 0; i < row.units.size(); ++i) {
      specs[i].unit = row.units[i];
    }
    EXPECT_EQ(assign_buckets(specs, row.caps), row.expected) << row.name;
    std::vector<size_t> order;
    for (const auto& bucket : row.expected) {
      order.insert(order.end(), bucket.begin(), bucket.end());
    }
    EXPECT_EQ(assign_buckets_in_order(specs, order, row.caps), row.expected) << row.name;
  }
}

// What the rule promises, checked on any layout it produced.
void expect_invariants(const std::vector<TensorSpec>& tensors, int64_t cap, const Buckets& buckets) {
  std::vector<size_t> seen;
  std::map<std::pair<int, int>, std::vector<size_t>> last_of_kind;
  for (const auto& bucket : buckets) {
    ASSERT_FALSE(bucket.empty()) << "an empty bucket";
    seen.insert(seen.end(), bucket.begin(), bucket.end());
    const TensorSpec& first = tensors[bucket.front()];
    int64_t size = 0;
    for (size_t i : bucket) {
      EXPECT_EQ(tensors[i].dtype, first.dtype) << "a bucket mixes dtypes";
      EXPECT_EQ(tensors[i].device, first.device) << "a bucket mixes devices";
      size += tensors[i].nbytes;
    }
    EXPECT_TRUE(std::is_sorted(bucket.rbegin(), bucket.rend()))
        << "a bucket not in reverse registration order";
    EXPECT_LT(size - tensors[bucket.back()].nbytes, cap)
        << "a bucket took a tensor after reaching its cap";
    const std::pair<int, int> kind{static_cast<int>(first.dtype), first.device.index()};
    const auto previous = last_of_kind.find(kind);
    if (previous != last_of_kind.end()) {
      EXPECT_GT(*std::min_element(previous->second.begin(), previous->second.end()),
                *std::max_element(bucket.begin(), bucket.end()));
      int64_t fill = 0;
      for (size_t i : previous->second) {
        fill += tensors[i].nbytes;
      }
      EXPECT_GE(fill, cap) << "a bucket was closed below its cap";
    }
    last_of_kind[kind] = bucket;
  }
  std::sort(seen.begin(), seen.end());
  std::vector<size_t> all(tensors.size());
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(seen, all) << "every tensor in exactly one bucket";
}

TEST(BucketAssignment, InvariantsOnRandomInputs) {
  std::mt19937 rng(0);
  const std::vector<int64_t> sizes = {0, 1, 4, 16, 64, 256};
  const std::vector<int64_t> caps = {1, 16, 64, 100, 1000, 1000000000};
  const std::vector<std::pair<c10::ScalarType, c10::Device>> kinds = {
      {at::kFloat, kCpu}, {at::kDouble, kCpu}, {at::kFloat, kGpu0}, {at::kHalf, kCpu}};
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<TensorSpec> tensors(rng() % 31);
    for (auto& t : tensors) {
      const auto& kind = kinds[rng() % kinds.size()];
      t = spec(sizes[rng() % sizes.size()], kind.first, kind.second);
    }
    const int64_t cap = caps[rng() % caps.size()];
    expect_invariants(tensors, cap, assign_buckets(tensors, cap, cap));
  }
}

Buckets sorted(Buckets buckets) {
  std::sort(buckets.begin(), buckets.end());
  return buckets;
}

// The same caps and visiting order group tensors as torch's DDP does
// (c10d::compute_bucket_assignment_by_size, given the tensors in visiting
// order with their indices, as torch's rebuild passes them). With several
// dtypes the two list the buckets in another order, so groups are compared.
TEST(BucketAssignment, MatchesTorchOnRandomInputs) {
  std::mt19937 rng(1);
  const std::vector<int64_t> numels = {0, 1, 3, 16, 64, 250};
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf};
  const std::vector<int64_t> first_caps = {1, 16, 100, 1000};
  const std::vector<int64_t> caps = {16, 100, 1000, 1000000000};
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 1 + rng() % 30;
    std::vector<at::Tensor> params;
    std::vector<TensorSpec> specs;
    for (size_t i = 0; i < n; ++i) {
      params.push_back(at::empty({numels[rng() % numels.size()]},
                                 at::TensorOptions().dtype(dtypes[rng() % dtypes.size()])));
      specs.push_back(spec(params.back().nbytes(), params.back().scalar_type()));
    }
    const std::vector<int64_t> trial_caps = {first_caps[rng() % first_caps.size()],
                                             caps[rng() % caps.size()]};
    std::vector<size_t> reverse(n);
    std::iota(reverse.rbegin(), reverse.rend(), 0);
    std::vector<size_t> shuffled(n);
    std::iota(shuffled.begin(), shuffled.end(), 0);
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    const std::vector<std::pair<std::vector<size_t>, Buckets>> ours = {
        {reverse, assign_buckets(specs, trial_caps[1], trial_caps[0])},
        {shuffled, assign_buckets_in_order(specs, shuffled, trial_caps)}};
    for (const auto& [order, buckets] : ours) {
      std::vector<at::Tensor> visited;
      std::vector<int64_t> indices;
      for (size_t i : order) {
        visited.push_back(params[i]);
        indices.push_back(static_cast<int64_t>(i));
      }
      const auto torchs = std::get<0>(c10d::compute_bucket_assignment_by_size(
          visited, {static_cast<size_t>(trial_caps[0]), static_cast<size_t>(trial_caps[1])},
          std::vector<bool>(n, false), indices));
      EXPECT_EQ(sorted(buckets), sorted(torchs)) << "trial " << trial;
    }
  }
}

struct TorchFirstRow {
  const char* name;
  std::vector<TensorSpec> tensors;
  std::vector<int64_t> caps;
  Buckets expected;
};

// torch's first buckets (Note [torch's first buckets]): cut in registration
// order, listed last bucket first, each in registration order.
TEST(BucketAssignment, TorchFirstTable) {
  constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();
  const std::vector<TorchFirstRow> rows = {
      {"empty", {}, {100}, {}},
      {"unlimited_one_bucket_in_registration_order", floats({4, 4, 4}), {kUnlimited}, {{0, 1, 2}}},
      {"partial_bucket_is_the_last_registered", floats({4, 4, 4}), {8}, {{2}, {0, 1}}},
      {"first_cap_on_the_first_registered", floats({4, 4, 4, 4, 4}), {4, 100}, {{1, 2, 3, 4}, {0}}},
      {"caps_list_in_turn", floats({4, 4, 4, 4, 4, 4}), {4, 8, 100}, {{3, 4, 5}, {1, 2}, {0}}},
      {"oversized_closes_its_bucket", floats({4, 100, 4}), {8}, {{2}, {0, 1}}},
      {"unlimited_one_bucket_per_dtype",
       {spec(4), spec(8, at::kDouble), spec(4), spec(8, at::kDouble)}, {kUnlimited}, {{1, 3}, {0, 2}}},
      {"kinds_listed_by_first_tensor",
       {spec(8, at::kDouble), spec(4), spec(4), spec(8, at::kDouble), spec(4)}, {8},
       {{4}, {3}, {1, 2}, {0}}},
  };
  for (const TorchFirstRow& row : rows) {
    EXPECT_EQ(assign_buckets_as_torch_first(row.tensors, row.caps), row.expected) << row.name;
  }
  std::vector<TensorSpec> sparse = floats({4, 4, 4});
  sparse[1].sparse = true;
  EXPECT_EQ(assign_buckets_as_torch_first(sparse, {kUnlimited}), (Buckets{{1}, {0, 2}}));
  std::vector<TensorSpec> units = floats({4, 4, 4, 4});
  units[1].unit = units[2].unit = 0;
  EXPECT_EQ(assign_buckets_as_torch_first(units, {kUnlimited}), (Buckets{{3}, {1, 2}, {0}}))
      << "droppable layers kept apart";
  EXPECT_THROW(assign_buckets_as_torch_first(floats({4}), {}), c10::Error);
  EXPECT_THROW(assign_buckets_as_torch_first(floats({4}), {0}), c10::Error);
}

// The layout equals the one torch's DDP builds its reducer with: torch's
// c10d::compute_bucket_assignment_by_size over the tensors in registration
// order (no indices given, so its buckets come sorted by first index),
// reversed as torch's _ddp_init_helper reverses them. Same order, bucket by
// bucket, with several dtypes and sparse gradients.
TEST(BucketAssignment, MatchesTorchFirstBucketsOnRandomInputs) {
  std::mt19937 rng(2);
  const std::vector<int64_t> numels = {0, 1, 3, 16, 64, 250};
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf};
  const std::vector<int64_t> cap_choices = {
      1, 16, 100, 1000, 1000000000, std::numeric_limits<int64_t>::max()};
  for (int trial = 0; trial < 300; ++trial) {
    const size_t n = 1 + rng() % 30;
    std::vector<at::Tensor> params;
    std::vector<TensorSpec> specs;
    std::vector<bool> sparse;
    for (size_t i = 0; i < n; ++i) {
      params.push_back(at::empty({numels[rng() % numels.size()]},
                                 at::TensorOptions().dtype(dtypes[rng() % dtypes.size()])));
      specs.push_back(spec(params.back().nbytes(), params.back().scalar_type()));
      sparse.push_back(rng() % 10 == 0);
      specs.back().sparse = sparse.back();
    }
    std::vector<int64_t> caps(1 + rng() % 3);
    std::vector<size_t> limits;
    for (int64_t& cap : caps) {
      cap = cap_choices[rng() % cap_choices.size()];
      limits.push_back(static_cast<size_t>(cap));
    }
    Buckets torchs = std::get<0>(c10d::compute_bucket_assignment_by_size(params, limits, sparse));
    std::reverse(torchs.begin(), torchs.end());
    EXPECT_EQ(assign_buckets_as_torch_first(specs, caps), torchs) << "trial " << trial;
  }
}

} // namespace
} // namespace ddp_ext::reducer
