// The step check's slots (reducer/agreement/step_slots.h): each rank's entry, summed
// as the allreduce sums them, read back by every rank. See Note [Ranks out
// of step].
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "reducer/agreement/step_slots.h"

namespace ddp_ext::reducer {
namespace {

// Sums every rank's written slots, as the check's allreduce does, and reads
// the sum as each rank.
std::vector<StepReading> exchange(const std::vector<StepEntry>& entries) {
  const StepSlots layout(static_cast<int>(entries.size()));
  std::vector<int64_t> sum(layout.size(), 0);
  std::vector<int64_t> mine(layout.size());
  for (size_t r = 0; r < entries.size(); ++r) {
    layout.write(mine.data(), static_cast<int>(r), entries[r]);
    for (size_t i = 0; i < sum.size(); ++i) {
      sum[i] += mine[i];
    }
  }
  std::vector<StepReading> readings;
  for (size_t r = 0; r < entries.size(); ++r) {
    readings.push_back(layout.read(sum.data(), static_cast<int>(r), entries[r].position));
  }
  return readings;
}

StepEntry backward(int64_t step, int64_t plan = 1, int64_t hooks = 1, int64_t rider = 0,
                   const int64_t* timings = nullptr) {
  return StepEntry{encode_position(CheckKind::kBackward, step), plan, hooks, rider, timings};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(StepSlots, LayoutHoldsThreeSlotsPerRankTheRiderAndThePhases) {
  EXPECT_EQ(StepSlots(1).size(), 3 + StepSlots::kTimings + 1);
  EXPECT_EQ(StepSlots(4).size(), (3 + StepSlots::kTimings) * 4 + 1);
  EXPECT_NE(encode_position(CheckKind::kBackward, 7), encode_position(CheckKind::kForward, 7));
  EXPECT_GT(encode_position(CheckKind::kBackward, 0), 0) << "0 is left to a rank that joined";
}

TEST(StepSlots, RanksInStepAgreeAndSumTheRider) {
  const auto readings = exchange({backward(5, 3, 2, 1), backward(5, 3, 2, 1), backward(5, 3, 2, 0)});
  for (const StepReading& reading : readings) {
    EXPECT_EQ(reading.error, "");
    EXPECT_EQ(reading.summed_rider, 2) << "two of three ranks voted";
    EXPECT_TRUE(reading.timings.empty()) << "no rank published timings";
  }
}

TEST(StepSlots, RanksOutOfStepAllRaiseTheSameMismatchNamingThePositions) {
  const auto readings = exchange({backward(5), backward(4), backward(5)});
  for (size_t r = 0; r < readings.size(); ++r) {
    const std::string& error = readings[r].error;
    EXPECT_TRUE(contains(error, "Detected mismatch between collectives on ranks")) << error;
    EXPECT_TRUE(contains(error, "out of step")) << error;
    EXPECT_TRUE(contains(error, "ranks 0, 2 in the backward of training step 5")) << error;
    EXPECT_TRUE(contains(error, "rank 1 in the backward of training step 4")) << error;
    EXPECT_TRUE(contains(error, "this is rank " + std::to_string(r))) << error;
  }
}

TEST(StepSlots, AForwardCheckMeetingABackwardCheckIsOutOfStep) {
  const auto readings = exchange({StepEntry{encode_position(CheckKind::kForward, 3)}, backward(3)});
  EXPECT_TRUE(contains(readings[0].error, "at a forward's buffer broadcast after 3")) << readings[0].error;
  EXPECT_EQ(readings[0].error.substr(0, 60), readings[1].error.substr(0, 60));
}

TEST(StepSlots, DifferentDroppedLayersAreNamedByPlan) {
  const auto readings = exchange({backward(2, 7), backward(2, 9)});
  EXPECT_TRUE(contains(readings[0].error, "dropped different layers")) << readings[0].error;
  EXPECT_TRUE(contains(readings[0].error, "rank 0 drew plan A; rank 1 drew plan B")) << readings[0].error;
}

TEST(StepSlots, DifferentHooksAreLetteredInRankOrder) {
  const auto readings = exchange({backward(2, 1, 1), backward(2, 1, 42), backward(2, 1, 42)});
  for (const StepReading& reading : readings) {
    EXPECT_TRUE(contains(reading.error, "registered different communication hooks (rank 0: none; ranks 1, 2: hook A)"))
        << reading.error;
  }
}

TEST(StepSlots, ARankThatJoinedComparesNothingAndIsNotCompared) {
  const auto readings = exchange({backward(6, 1, 1, 1), StepEntry{}, backward(6, 1, 1, 1)});
  EXPECT_EQ(readings[0].error, "");
  EXPECT_EQ(readings[0].summed_rider, 2);
  EXPECT_EQ(readings[1].error, "") << "the joined rank reads nothing";
  EXPECT_EQ(readings[1].summed_rider, 0);
}

TEST(StepSlots, PhasesArriveRankMajor) {
  const int64_t first[StepSlots::kTimings] = {11, 12, 13};
  const int64_t second[StepSlots::kTimings] = {21, 22, 23};
  const auto readings = exchange({backward(1, 1, 1, 0, first), backward(1, 1, 1, 0, second)});
  EXPECT_EQ(readings[1].timings, (std::vector<int64_t>{11, 12, 13, 21, 22, 23}));
}

TEST(StepSlots, ManyRanksAreCountedNotListed) {
  std::vector<StepEntry> entries(12, backward(3));
  entries[11] = backward(2);
  const std::string error = exchange(entries)[0].error;
  EXPECT_TRUE(contains(error, "ranks 0, 1, 2, 3, 4, 5, 6, 7 and 3 more in the backward of training step 3")) << error;
}

} // namespace
} // namespace ddp_ext::reducer
