// The step check's slots: writing one rank's entry, and reading the sum
// with the messages every rank raises. See Note [Ranks out of step] in
// reducer/agreement/step_check.h.
#include "reducer/agreement/step_slots.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <utility>

namespace ddp_ext::reducer {

int64_t encode_position(CheckKind kind, int64_t count) {
  return 1 + 2 * count + static_cast<int64_t>(kind);
}

namespace {

std::string describe_position(int64_t slot) {
  const int64_t count = (slot - 1) / 2;
  std::ostringstream text;
  if ((slot - 1) % 2 == static_cast<int64_t>(CheckKind::kBackward)) {
    text << "in the backward of training step " << count;
  } else {
    text << "at a forward's buffer broadcast after " << count
         << " synchronising backward passes";
  }
  return text.str();
}

// "rank 3", "ranks 0, 2, 5", "ranks 0, 1, 2, 3, 4, 5, 6, 7 and 9 more".
std::string describe_ranks(const std::vector<int64_t>& ranks) {
  constexpr size_t kNamed = 8;
  std::ostringstream text;
  text << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size() && i < kNamed; ++i) {
    text << (i == 0 ? "" : ", ") << ranks[i];
  }
  if (ranks.size() > kNamed) {
    text << " and " << ranks.size() - kNamed << " more";
  }
  return text.str();
}

std::string plans_differ_message(
    int rank, int64_t slot, const std::map<int64_t, std::vector<int64_t>>& ranks_with) {
  std::ostringstream message;
  message << "Detected mismatch between collectives on ranks: the ranks of "
             "this DistributedDataParallel module dropped different layers "
             "(";
  size_t plan = 0;
  for (const auto& entry : ranks_with) {
    message << (plan == 0 ? "" : "; ") << describe_ranks(entry.second)
            << " drew plan " << static_cast<char>('A' + std::min<size_t>(plan, 25));
    ++plan;
  }
  message << ", " << describe_position(slot) << "; this is rank " << rank
          << "). Their bucket allreduces would pair different buckets, so "
             "none was sent and this iteration's gradients were not averaged. "
             "Every rank must drop "
             "the same layers: give each ddp_ext.LayerDrop the same seed on "
             "every rank (the wrapper broadcasts rank 0's when it is built), "
             "and call each one the same number of times in training mode on "
             "every rank.";
  return message.str();
}

std::string hooks_differ_message(
    int64_t slot, const std::map<int64_t, std::vector<int64_t>>& ranks_with) {
  std::ostringstream message;
  message << "DistributedDataParallel: the ranks registered different "
             "communication hooks (";
  // In the order of each group's first rank; hooks lettered in that order.
  std::vector<std::pair<int64_t, const std::vector<int64_t>*>> groups;
  for (const auto& [fingerprint, ranks] : ranks_with) {
    groups.emplace_back(fingerprint, &ranks);
  }
  std::sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) {
    return a.second->front() < b.second->front();
  });
  char label = 'A';
  bool first = true;
  for (const auto& [fingerprint, ranks] : groups) {
    message << (first ? "" : "; ") << describe_ranks(*ranks) << ": ";
    if (fingerprint == 1) {
      message << "none";
    } else {
      message << "hook " << label;
      label = label == 'Z' ? 'Z' : static_cast<char>(label + 1);
    }
    first = false;
  }
  message << "), found by the step check " << describe_position(slot)
          << ": a hook was registered after the first forward, where the "
             "ranks' hooks are compared by name. Each rank's buckets would "
             "run different collectives, so the ranks "
             "with a new hook sent no bucket, the others' bucket allreduces "
             "were dropped without a partner, and this iteration's gradients "
             "were not averaged. Register the same hook on every rank before "
             "the first forward; the process group may still hold the "
             "dropped allreduces, so restart from a checkpoint.";
  return message.str();
}

std::string out_of_step_message(
    int rank, const std::map<int64_t, std::vector<int64_t>>& ranks_at) {
  std::ostringstream message;
  message << "Detected mismatch between collectives on ranks: the ranks of "
             "this DistributedDataParallel module are out of step (";
  bool first = true;
  for (const auto& [slot, ranks] : ranks_at) {
    message << (first ? "" : "; ") << describe_ranks(ranks) << " "
            << describe_position(slot);
    first = false;
  }
  message << "; this is rank " << rank << "), so their collectives paired "
             "different iterations' gradients and buffers, and this "
             "iteration's gradients are not valid. A rank ran a synchronising "
             "forward or backward that the others did not: it caught an "
             "exception raised in its forward and went on, skipped a "
             "backward, or ran a forward in training mode with gradients "
             "enabled that the others did not run (run evaluation under "
             "torch.no_grad(), in eval mode, or on ddp_model.module). Every "
             "rank must run the same synchronising forward and backward "
             "passes; for uneven inputs use "
             "torch.distributed.algorithms.join.Join.";
  return message.str();
}

} // namespace

template <typename Float>
void encode_pieces(const int64_t* slots, int64_t count, Float* out) {
  constexpr uint64_t kMask = (uint64_t{1} << kPieceBits) - 1;
  for (int64_t i = 0; i < count; ++i) {
    TORCH_INTERNAL_ASSERT(slots[i] >= 0, "step check slots are non-negative");
    auto value = static_cast<uint64_t>(slots[i]);
    for (int p = 0; p < kPieces; ++p) {
      out[i * kPieces + p] = static_cast<Float>(value & kMask);
      value >>= kPieceBits;
    }
  }
}

template <typename Float>
void decode_pieces(const Float* pieces, int64_t count, int64_t* slots) {
  constexpr Float kExact = Float(1 << 24);
  for (int64_t i = 0; i < count; ++i) {
    uint64_t value = 0;
    for (int p = kPieces - 1; p >= 0; --p) {
      const Float piece = pieces[i * kPieces + p];
      TORCH_CHECK(
          piece >= 0 && piece < kExact && piece == static_cast<Float>(static_cast<int64_t>(piece)),
          "the step check carried on bucket 0 came back with piece ", piece,
          " of slot ", i, ", which no exact sum of its pieces gives: a rank "
          "sent a bucket 0 of a different layout");
      value = (value << kPieceBits) + static_cast<uint64_t>(piece);
    }
    slots[i] = static_cast<int64_t>(value);
  }
}

template void encode_pieces<float>(const int64_t*, int64_t, float*);
template void encode_pieces<double>(const int64_t*, int64_t, double*);
template void decode_pieces<float>(const float*, int64_t, int64_t*);
template void decode_pieces<double>(const double*, int64_t, int64_t*);

StepSlots::StepSlots(int world_size) : world_size_(world_size) {
  TORCH_CHECK(world_size > 0, "a step check needs at least one rank");
}

int64_t StepSlots::size() const {
  return (3 + kTimings) * static_cast<int64_t>(world_size_) + 1;
}

void StepSlots::write(int64_t* values, int rank, const StepEntry& entry) const {
  TORCH_INTERNAL_ASSERT(rank >= 0 && rank < world_size_, "rank ", rank, " of ", world_size_);
  std::fill(values, values + size(), 0);
  values[rank] = entry.position;
  values[world_size_ + rank] = entry.plan;
  values[2 * world_size_ + rank] = entry.hooks;
  values[3 * world_size_] = entry.rider;
  if (entry.timings != nullptr) {
    std::copy(entry.timings, entry.timings + kTimings, values + 3 * world_size_ + 1 + kTimings * rank);
  }
}

StepReading StepSlots::read(const int64_t* values, int rank, int64_t written) const {
  StepReading reading;
  if (written == 0) {
    return reading; // A rank that joined has no position to compare.
  }
  reading.summed_rider = values[3 * world_size_];
  const int64_t* timings = values + 3 * world_size_ + 1;
  const int64_t count = static_cast<int64_t>(kTimings) * world_size_;
  if (std::any_of(timings, timings + count, [](int64_t v) { return v != 0; })) {
    reading.timings.assign(timings, timings + count);
  }
  std::map<int64_t, std::vector<int64_t>> ranks_at;
  std::map<int64_t, std::vector<int64_t>> ranks_with_plan;
  std::map<int64_t, std::vector<int64_t>> ranks_with_hooks;
  for (int64_t r = 0; r < world_size_; ++r) {
    if (values[r] > 0) {
      ranks_at[values[r]].push_back(r);
    }
    if (values[world_size_ + r] > 0) {
      ranks_with_plan[values[world_size_ + r]].push_back(r);
    }
    if (values[2 * world_size_ + r] > 0) {
      ranks_with_hooks[values[2 * world_size_ + r]].push_back(r);
    }
  }
  if (ranks_at.size() != 1) {
    reading.error = out_of_step_message(rank, ranks_at);
  } else if (ranks_with_plan.size() > 1) {
    // In step; backward checks also compare what each rank dropped.
    reading.error = plans_differ_message(rank, written, ranks_with_plan);
  } else if (ranks_with_hooks.size() > 1) {
    reading.error = hooks_differ_message(written, ranks_with_hooks);
  }
  return reading;
}

} // namespace ddp_ext::reducer
