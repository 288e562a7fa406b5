// The adaptive-precision decisions (comm_hooks/compression/precision_policy.h):
// warm-up, critical regimes, turning compression off while it is slower, and
// re-measuring the choice not taken. See Note [Adaptive precision].
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm_hooks/compression/precision_policy.h"

namespace ddp_ext::compression {
namespace {

PolicyOptions options(int64_t warmup = 20) {
  PolicyOptions o;
  o.warmup_iterations = warmup;
  o.check_every = 10;
  o.critical_change = 0.3;
  o.reprobe_every = 3;
  return o;
}

std::vector<std::string> formats(const PrecisionPolicy& policy, size_t buckets) {
  std::vector<std::string> names;
  for (size_t b = 0; b < buckets; ++b) {
    names.emplace_back(precision_name(policy.format(b)));
  }
  return names;
}

struct WindowRow {
  std::vector<double> sq_norms;
  double cost_ms;
  int64_t iterations; // at the window's end
  std::string mode; // of the next window
  std::vector<std::string> formats;
};

TEST(PrecisionPolicy, WarmupCriticalRegimesAndReprobes) {
  PrecisionPolicy policy(options());
  EXPECT_STREQ(window_mode_name(policy.mode()), "warmup");
  EXPECT_EQ(formats(policy, 1), std::vector<std::string>{"fp32"});
  const std::vector<WindowRow> rows = {
      {{4.0, 1.0}, 10.0, 10, "warmup", {"fp32", "fp32"}},
      {{4.0, 1.0}, 10.0, 20, "compressed", {"int8", "int8"}}, // steady norms
      {{4.0, 2.0}, 6.0, 30, "compressed", {"int8", "fp16"}}, // bucket 1's norm x1.41: critical
      {{4.0, 2.0}, 6.0, 40, "compressed", {"int8", "int8"}},
      {{0.0, 2.0}, 6.0, 50, "probe_full", {"fp32", "fp32"}}, // every 3 windows: re-measure fp32
      {{4.0, 2.0}, 9.0, 60, "compressed", {"fp16", "int8"}}, // fp32 at 9 > 6; bucket 0 unseen
  };
  for (const WindowRow& row : rows) {
    policy.conclude_window(WindowReport{row.sq_norms, row.cost_ms}, row.iterations);
    EXPECT_EQ(window_mode_name(policy.mode()), row.mode) << "after " << row.iterations;
    EXPECT_EQ(formats(policy, 2), row.formats) << "after " << row.iterations;
  }
  EXPECT_EQ(policy.full_cost_ms(), 9.0);
  EXPECT_EQ(policy.compressed_cost_ms(), 6.0);
}

TEST(PrecisionPolicy, OffWhileSlowerThenProbedAgain) {
  PrecisionPolicy policy(options(/*warmup=*/10));
  const auto conclude = [&](double cost, int64_t iterations) {
    policy.conclude_window(WindowReport{{1.0}, cost}, iterations);
    return std::string(window_mode_name(policy.mode()));
  };
  EXPECT_EQ(conclude(5.0, 10), "compressed"); // warm-up measured fp32 at 5 ms
  EXPECT_EQ(conclude(8.0, 20), "full"); // compression: 8 ms > 5 ms
  EXPECT_EQ(formats(policy, 1), std::vector<std::string>{"fp32"});
  EXPECT_EQ(conclude(5.0, 30), "full");
  EXPECT_EQ(conclude(5.0, 40), "probe_compressed"); // 3 windows since warm-up
  EXPECT_EQ(formats(policy, 1), std::vector<std::string>{"int8"});
  EXPECT_EQ(conclude(4.0, 50), "compressed"); // now it pays
}

TEST(PrecisionPolicy, WithoutInt8AndWithoutTurningOff) {
  PolicyOptions o = options(/*warmup=*/0);
  o.int8_allowed = false;
  o.off_when_slower = false;
  PrecisionPolicy policy(o);
  EXPECT_STREQ(window_mode_name(policy.mode()), "compressed");
  EXPECT_EQ(formats(policy, 1), std::vector<std::string>{"fp16"});
  for (int64_t i = 1; i < 8; ++i) {
    policy.conclude_window(WindowReport{{1.0}, i % 2 ? 100.0 : 1.0}, 10 * i);
    EXPECT_STREQ(window_mode_name(policy.mode()), "compressed");
    EXPECT_EQ(formats(policy, 1), std::vector<std::string>{"fp16"});
  }
}

TEST(PrecisionPolicy, OptionsAreChecked) {
  const auto refused = [](PolicyOptions o, const std::string& phrase) {
    try {
      PrecisionPolicy policy(o);
      return std::string("accepted");
    } catch (const c10::Error& error) {
      return std::string(error.what()).find(phrase) != std::string::npos ? std::string("refused")
                                                                          : std::string(error.what());
    }
  };
  PolicyOptions o = options();
  o.check_every = 0;
  EXPECT_EQ(refused(o, "check_every must be at least 1"), "refused");
  o = options();
  o.warmup_iterations = -1;
  EXPECT_EQ(refused(o, "warmup_iterations must be 0 or more"), "refused");
  o = options();
  o.critical_change = -0.1;
  EXPECT_EQ(refused(o, "critical_change must be 0 or more"), "refused");
  o = options();
  o.reprobe_every = 0;
  EXPECT_EQ(refused(o, "reprobe_every must be at least 1"), "refused");
}

} // namespace
} // namespace ddp_ext::compression
