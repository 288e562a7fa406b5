// The step check's slots (reducer/agreement/step_slots.h): each rank's entry, summed
// as the allreduce sums them, read back by every rank. See Note [Ranks out
// of step].
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
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

// See Note [The step check on bucket 0]: the slots as exact floating-point
// pieces, summed in float32 or float64 as a bucket's allreduce sums them.
template <typename Float>
std::vector<StepReading> exchange_as_pieces(const std::vector<StepEntry>& entries) {
  const StepSlots layout(static_cast<int>(entries.size()));
  const int64_t pieces = kPieces * layout.size();
  std::vector<Float> sum(pieces, Float(0));
  std::vector<int64_t> mine(layout.size());
  std::vector<Float> encoded(pieces);
  for (size_t r = 0; r < entries.size(); ++r) {
    layout.write(mine.data(), static_cast<int>(r), entries[r]);
    encode_pieces(mine.data(), layout.size(), encoded.data());
    for (int64_t i = 0; i < pieces; ++i) {
      sum[i] += encoded[i];
    }
  }
  std::vector<int64_t> slots(layout.size());
  decode_pieces(sum.data(), layout.size(), slots.data());
  std::vector<StepReading> readings;
  for (size_t r = 0; r < entries.size(); ++r) {
    readings.push_back(layout.read(slots.data(), static_cast<int>(r), entries[r].position));
  }
  return readings;
}

TEST(StepSlotsAsPieces, LargeFingerprintsAndPhasesSurviveAFloat32Sum) {
  const int64_t big = (int64_t{1} << 62) + 12345; // a hash of 63 bits
  const int64_t phases[StepSlots::kTimings] = {(int64_t{1} << 40) + 7, 3, 1};
  std::vector<StepEntry> entries;
  for (int r = 0; r < 5; ++r) {
    entries.push_back(backward(1000003, big, big - 1, /*rider=*/1, r == 2 ? phases : nullptr));
  }
  for (const StepReading& reading : exchange_as_pieces<float>(entries)) {
    EXPECT_EQ(reading.error, "");
    EXPECT_EQ(reading.summed_rider, 5);
    ASSERT_EQ(reading.timings.size(), 5u * StepSlots::kTimings);
    EXPECT_EQ(reading.timings[2 * StepSlots::kTimings], phases[0]);
    EXPECT_EQ(reading.timings[2 * StepSlots::kTimings + 1], 3);
  }
}

TEST(StepSlotsAsPieces, FingerprintsDifferingInTheirHighBitsStillDiffer) {
  const int64_t a = (int64_t{1} << 61) + 1;
  const int64_t b = (int64_t{1} << 60) + 1;
  for (const StepReading& reading : exchange_as_pieces<float>({backward(3, 1, a), backward(3, 1, b)})) {
    EXPECT_TRUE(contains(reading.error, "registered different communication hooks")) << reading.error;
  }
  for (const StepReading& reading : exchange_as_pieces<double>({backward(3), backward(4)})) {
    EXPECT_TRUE(contains(reading.error, "out of step")) << reading.error;
  }
}

TEST(StepSlotsAsPieces, EveryPieceIsExactInFloat32) {
  const int64_t values[] = {0, 1, (int64_t{1} << 22) - 1, int64_t{1} << 22, INT64_MAX};
  std::vector<float> pieces(kPieces * 5);
  encode_pieces(values, 5, pieces.data());
  for (float piece : pieces) {
    EXPECT_LT(piece, float(1 << kPieceBits));
    EXPECT_EQ(piece, static_cast<float>(static_cast<int64_t>(piece)));
  }
  std::vector<int64_t> back(5);
  decode_pieces(pieces.data(), 5, back.data());
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(back[i], values[i]);
  }
}

TEST(StepSlotsAsPieces, APieceNoExactSumGivesRaises) {
  const float pieces[kPieces] = {0.5f, 0.f, 0.f}; // a gradient where a piece was
  int64_t slot = 0;
  EXPECT_THROW(decode_pieces(pieces, 1, &slot), c10::Error);
  const float negative[kPieces] = {-1.f, 0.f, 0.f};
  EXPECT_THROW(decode_pieces(negative, 1, &slot), c10::Error);
}

} // namespace
} // namespace ddp_ext::reducer
