#include "reducer/step_check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <map>
#include <sstream>
#include <vector>

#include "reducer/cuda_streams.h"

namespace ddp_ext::reducer {

namespace {

// A slot holds 0 (a rank that joined) or 1 + 2 * count + kind.
enum CheckKind : int64_t { kBackwardCheck = 0, kForwardCheck = 1 };

int64_t encode(CheckKind kind, int64_t count) {
  return 1 + 2 * count + kind;
}

std::string describe_position(int64_t slot) {
  const int64_t count = (slot - 1) / 2;
  std::ostringstream text;
  if ((slot - 1) % 2 == kBackwardCheck) {
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

StepCheck::StepCheck(int rank, int world_size, c10::Device device)
    : rank_(rank), world_size_(world_size) {
  host_ = at::zeros({(3 + kPhases) * world_size + 1}, at::kLong);
  slots_ = device.is_cpu() ? host_ : host_.to(device);
}

void StepCheck::start(
    c10d::ProcessGroup& group, int64_t slot_value, int64_t plan, int64_t hooks,
    int64_t rider, const int64_t* phases) {
  TORCH_INTERNAL_ASSERT(!work_, "a step check is already in flight");
  written_ = slot_value;
  summed_rider_ = 0;
  host_.zero_();
  int64_t* values = host_.data_ptr<int64_t>();
  values[rank_] = slot_value;
  values[world_size_ + rank_] = plan;
  values[2 * world_size_ + rank_] = hooks;
  values[3 * world_size_] = rider;
  if (phases != nullptr) {
    std::copy(phases, phases + kPhases, values + 3 * world_size_ + 1 + kPhases * rank_);
  }
  if (!slots_.is_same(host_)) {
    // See Note [CUDA streams], point 5: no host wait in the backward pass.
    const bool snapshot = slots_.is_cuda();
    slots_.copy_(
        snapshot ? host_snapshot_for_copy(host_, slots_.device()) : host_,
        /*non_blocking=*/snapshot);
  }
  std::vector<at::Tensor> tensors{slots_};
  work_ = group.allreduce(tensors);
}

void StepCheck::launch_backward(
    c10d::ProcessGroup& group, int64_t step, int64_t rider, int64_t plan,
    int64_t hooks, const int64_t* phases) {
  TORCH_INTERNAL_ASSERT(plan > 0 && hooks > 0, "fingerprints are positive");
  start(group, encode(kBackwardCheck, step), plan, hooks, rider, phases);
}

void StepCheck::launch_forward(c10d::ProcessGroup& group, int64_t backwards) {
  start(group, encode(kForwardCheck, backwards), 0, 0, 0, nullptr);
}

void StepCheck::launch_as_joined(c10d::ProcessGroup& group) {
  start(group, 0, 0, 0, 0, nullptr);
}

bool StepCheck::launched() const {
  return static_cast<bool>(work_);
}

std::string StepCheck::wait(StallWatch* watch) {
  TORCH_INTERNAL_ASSERT(work_, "no step check in flight");
  auto work = std::move(work_);
  work_.reset();
  if (watch != nullptr) {
    watch->wait(*work, "step check", -1);
  } else {
    work->wait();
  }
  if (written_ == 0) {
    return std::string(); // A rank that joined has no position to compare.
  }
  const at::Tensor slots = slots_.is_same(host_) ? host_ : slots_.cpu();
  const int64_t* values = slots.data_ptr<int64_t>();
  summed_rider_ = values[3 * world_size_];
  const int64_t* phases = values + 3 * world_size_ + 1;
  const int64_t count = static_cast<int64_t>(kPhases) * world_size_;
  phases_.clear();
  if (std::any_of(phases, phases + count, [](int64_t v) { return v != 0; })) {
    phases_.assign(phases, phases + count);
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
    return out_of_step_message(rank_, ranks_at);
  }
  // In step; backward checks also compare what each rank dropped.
  if (ranks_with_plan.size() > 1) {
    return plans_differ_message(rank_, written_, ranks_with_plan);
  }
  if (ranks_with_hooks.size() > 1) {
    return hooks_differ_message(written_, ranks_with_hooks);
  }
  return std::string();
}

void StepCheck::drop() {
  if (work_ && !slots_.is_same(host_)) {
    // See Note [CUDA streams], point 7: it may still be writing slots_.
    slots_ = at::empty_like(slots_);
  }
  work_.reset();
}

std::string StepCheck::check_forward(
    c10d::ProcessGroup& group, int64_t backwards, StallWatch* watch) {
  drop();
  launch_forward(group, backwards);
  return wait(watch);
}

void StepCheck::match_as_joined(c10d::ProcessGroup& group) {
  drop();
  launch_as_joined(group);
  wait();
}

} // namespace ddp_ext::reducer
