#include "reducer/participation/usage.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_set>
#include <utility>

#include "reducer/base/cuda_streams.h"

namespace ddp_ext::reducer {

std::vector<size_t> find_unreached_accumulators(
    const std::vector<at::Tensor>& outputs,
    const std::vector<AccumulatorPtr>&
        accumulators) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> stack;
  for (const auto& output : outputs) {
    if (!output.defined() || !output.requires_grad()) {
      continue;
    }
    const auto* node = torch::autograd::impl::gradient_edge(output).function.get();
    if (node != nullptr && seen.insert(node).second) {
      stack.push_back(node);
    }
  }
  while (!stack.empty()) {
    const auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      const auto* next = edge.function.get();
      if (next != nullptr && seen.insert(next).second) {
        stack.push_back(next);
      }
    }
  }
  std::vector<size_t> unreached;
  for (size_t i = 0; i < accumulators.size(); ++i) {
    if (seen.count(accumulators[i].get()) == 0) {
      unreached.push_back(i);
    }
  }
  return unreached;
}

Usage::Usage(size_t params, c10::Device device, bool search)
    : search_(search),
      local_(at::zeros({static_cast<int64_t>(params)}, at::kInt)),
      used_(local_.data_ptr<int32_t>()),
      for_allreduce_(
          device.is_cpu()
              ? local_
              : at::zeros({static_cast<int64_t>(params)},
                          at::TensorOptions(at::kInt).device(device))) {}

std::vector<bool> Usage::used_locally() const {
  std::vector<bool> used(static_cast<size_t>(local_.numel()));
  for (size_t i = 0; i < used.size(); ++i) {
    used[i] = used_[i] != 0;
  }
  return used;
}

at::Tensor Usage::bitmap_copy() const {
  return local_.to(for_allreduce_.device(), /*non_blocking=*/false, /*copy=*/true);
}

void Usage::set_unused(std::vector<size_t> unused, bool compare) {
  if (compare && unused != unused_) {
    stable_ = false;
  }
  unused_ = std::move(unused);
  is_unused_.assign(static_cast<size_t>(local_.numel()), false);
  for (size_t index : unused_) {
    is_unused_[index] = true;
  }
}

void Usage::launch_allreduce(c10d::ProcessGroup& group) {
  if (!for_allreduce_.is_same(local_)) {
    // See Note [CUDA streams], point 5.
    for_allreduce_.copy_(
        host_snapshot_for_copy(local_, for_allreduce_.device()),
        /*non_blocking=*/true);
  }
  std::vector<at::Tensor> tensors{for_allreduce_};
  work_ = group.allreduce(tensors);
}

std::vector<bool> Usage::wait(bool local, StallWatch* watch) {
  if (work_) {
    if (watch != nullptr) {
      watch->wait(*work_, "usage", -1);
    } else {
      work_->wait();
    }
    work_.reset();
  }
  const at::Tensor used = local ? local_ : for_allreduce_.cpu();
  const int32_t* counts = used.data_ptr<int32_t>();
  std::vector<bool> globally_used(static_cast<size_t>(used.numel()));
  for (size_t i = 0; i < globally_used.size(); ++i) {
    globally_used[i] = counts[i] > 0;
  }
  local_.zero_();
  return globally_used;
}

void Usage::restore_stashed(
    const std::vector<at::Tensor>& params,
    const std::function<bool(size_t)>& used_by_no_rank) {
  for (const auto& [index, stash] : stashed_) {
    if (used_by_no_rank(index)) {
      params[index].mutable_grad().copy_(stash);
      keep_for_current_stream(stash); // See Note [CUDA streams], point 4.
    }
  }
  stashed_.clear();
}

void Usage::drop(bool clear) {
  work_.reset();
  stashed_.clear();
  if (clear) {
    local_.zero_();
  }
}

} // namespace ddp_ext::reducer
