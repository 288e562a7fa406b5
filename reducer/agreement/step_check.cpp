#include "reducer/agreement/step_check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <utility>
#include <vector>

#include "reducer/core/cuda_streams.h"

namespace ddp_ext::reducer {

StepCheck::StepCheck(int rank, int world_size, c10::Device device)
    : rank_(rank), layout_(world_size) {
  host_ = at::zeros({layout_.size()}, at::kLong);
  slots_ = device.is_cpu() ? host_ : host_.to(device);
}

void StepCheck::start(c10d::ProcessGroup& group, const StepEntry& entry) {
  TORCH_INTERNAL_ASSERT(!work_, "a step check is already in flight");
  written_ = entry.position;
  summed_rider_ = 0;
  layout_.write(host_.data_ptr<int64_t>(), rank_, entry);
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
    int64_t hooks, const int64_t* timings) {
  TORCH_INTERNAL_ASSERT(plan > 0 && hooks > 0, "fingerprints are positive");
  start(group, StepEntry{encode_position(CheckKind::kBackward, step), plan, hooks, rider, timings});
}

void StepCheck::launch_forward(c10d::ProcessGroup& group, int64_t backwards) {
  start(group, StepEntry{encode_position(CheckKind::kForward, backwards)});
}

void StepCheck::launch_as_joined(c10d::ProcessGroup& group) {
  start(group, StepEntry{});
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
  StepReading reading = layout_.read(slots.data_ptr<int64_t>(), rank_, written_);
  summed_rider_ = reading.summed_rider;
  timings_ = std::move(reading.timings);
  return reading.error;
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
