#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp_ext::reducer {

// What a step check carries, as plain int64 slots that one allreduce sums
// (Note [Ranks out of step] in reducer/agreement/step_check.h): the typed entry each
// rank writes, the layout of the slots, and what every rank reads back from
// the sum. Pure: no tensor, no process group.

// Which kind of check wrote a position.
enum class CheckKind : int64_t { kBackward = 0, kForward = 1 };

// A position as a rank writes it: 1 + 2 * count + kind (0 is left to a rank
// that joined). `count`: the training step of a backward check, the
// synchronising backwards begun of a forward check.
int64_t encode_position(CheckKind kind, int64_t count);

// One rank's entry.
struct StepEntry {
  int64_t position = 0; // encode_position(...); 0: a rank that joined
  int64_t plan = 0; // the dropped layers' fingerprint (Note [Layer dropping]); 0: none compared
  int64_t hooks = 0; // the hooks' fingerprint (Note [Hooks registered after the first forward]); 0: none compared
  int64_t rider = 0; // summed over the ranks (the rebuild vote)
  const int64_t* timings = nullptr; // kTimings values (Note [Stragglers]), or null
};

// What the summed slots say to the rank that wrote `written`.
struct StepReading {
  std::string error; // empty: the ranks with data are in step and agree
  int64_t summed_rider = 0;
  std::vector<int64_t> timings; // every rank's (rank-major); empty if none wrote any
};

// The slots of a world of `world_size` ranks: W positions, W plan and W hook
// fingerprints, the rider, and kTimings values per rank.
// The slots as exact floating-point pieces, for a check that rides on a
// bucket's allreduce (Note [The step check on bucket 0]): each slot, a
// non-negative int64, becomes kPieces integers of at most kPieceBits bits,
// which float32 (24-bit significand) and float64 hold exactly, and whose sums
// over the ranks stay exact (every slot but the rider is written by one rank;
// the rider, a vote of 0 or 1, sums to at most the world size).
constexpr int kPieces = 3;
constexpr int kPieceBits = 22;
// `count` slots into count * kPieces values of `out` (float or double).
template <typename Float>
void encode_pieces(const int64_t* slots, int64_t count, Float* out);
// The inverse, from summed pieces; raises if a piece is not a whole number
// below 2^24 (what only a sum that was not exact can give).
template <typename Float>
void decode_pieces(const Float* pieces, int64_t count, int64_t* slots);

class StepSlots {
 public:
  static constexpr int kTimings = 3; // StepTimings::kTimings (Note [Stragglers])

  explicit StepSlots(int world_size);

  int64_t size() const;

  // Writes `entry` into rank `rank`'s slots of `values` (size() long), and
  // zeros everywhere else.
  void write(int64_t* values, int rank, const StepEntry& entry) const;

  // Reads the summed `values` as rank `rank` that wrote position `written`
  // (0: a rank that joined, which compares nothing).
  StepReading read(const int64_t* values, int rank, int64_t written) const;

 private:
  int world_size_;
};

} // namespace ddp_ext::reducer
