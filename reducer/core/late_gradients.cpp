// Gradients of a second backward over a synchronised forward, recorded.
#include "reducer/core/late_gradients.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>

#include "reducer/core/reducer.h"

namespace ddp_ext::reducer {

LateGradients::LateGradients(size_t params) : recorded_(params, false) {}

void LateGradients::on_forward() {
  open_ = false;
  judged_task_ = -1;
  forward_thread_ = at::RecordFunction::currentThreadId();
  first_node_ = at::sequence_number::peek();
  end_node_ = first_node_;
}

void LateGradients::on_backward_armed() {
  open_ = false;
  const uint64_t thread = at::RecordFunction::currentThreadId();
  if (thread != forward_thread_) {
    // Prepared from another thread than the forward's (a framework):
    // everything that thread created so far.
    forward_thread_ = thread;
    first_node_ = 0;
  }
  end_node_ = at::sequence_number::peek();
}

void LateGradients::on_gradients_done() {
  open_ = true;
  judged_task_ = -1;
}

void LateGradients::record(size_t index) {
  if (!open_ || recorded_[index] || !through_synchronised_forward()) {
    return;
  }
  recorded_[index] = true;
  ++count_;
}

bool LateGradients::through_synchronised_forward() {
  const int64_t task = torch::autograd::get_current_graph_task_id();
  if (task < 0) {
    return false; // not inside a backward
  }
  if (task == judged_task_) {
    return judged_late_;
  }
  judged_task_ = task;
  judged_late_ = false;
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes != nullptr) {
    judged_late_ = std::any_of(nodes->begin(), nodes->end(), [this](const torch::autograd::Node* node) {
      const uint64_t number = node->sequence_nr();
      return node->thread_id() == forward_thread_ && number >= first_node_ && number < end_node_;
    });
  }
  return judged_late_;
}

std::vector<size_t> LateGradients::take() {
  std::vector<size_t> indices;
  indices.reserve(count_);
  for (size_t i = 0; i < recorded_.size(); ++i) {
    if (recorded_[i]) {
      indices.push_back(i);
      recorded_[i] = false;
    }
  }
  count_ = 0;
  return indices;
}

bool Reducer::has_late_gradients() const {
  const auto lock = lock_state(Access::kRead);
  return late_.any();
}

std::vector<size_t> Reducer::take_late_gradients() {
  const auto lock = lock_state(Access::kChange);
  return late_.take();
}

} // namespace ddp_ext::reducer
